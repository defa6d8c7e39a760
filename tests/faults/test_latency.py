"""Slow servers rather than dead ones: latency on one executor's link to Postgres, and Postgres
stalled by a lock. Nothing may run twice at once, nothing be lost, every task end; and a server
that is slow, not gone, must not cost the attempts it holds. Each case was found by an
adversarial review, where it failed: the docstrings say what happened; each test shows it no
longer does.

A sampler reads /proc every 0.2 s for every task's processes; at no sample may two attempts of
one task have a running (not stopped) process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import asyncpg

from shared.client import SkedClient
from shared.fsm import State
from tests.faults.checks import Sampler, sampling
from tests.faults.conftest import Deployment
from tests.faults.jobs import FAST, shell_stamp, start_all
from tests.faults.proxy import Proxy
from tests.helpers import eventually

# -- a TCP proxy that adds latency each way, keeping order -----------------------------------


class SlowProxy(Proxy):
    """Proxy (tests/faults/proxy.py) that delays every chunk by `delay()` seconds each way,
    keeping order: a chunk is never delivered before the one read before it."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.delay: Callable[[], float] = lambda: 0.0

    def fixed(self, s: float) -> None:
        self.delay = lambda: s

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, _token: object = None
    ) -> None:
        q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        last = 0.0

        async def deliver() -> None:
            while True:
                at, data = await q.get()
                if not data:
                    return
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        out = asyncio.create_task(deliver())
        try:
            while True:
                data = await src.read(65536)
                last = max(last, time.monotonic() + self.delay())
                await q.put((last, data))
                if not data:
                    break
            await out
        finally:
            out.cancel()


@contextlib.asynccontextmanager
async def slow_proxy(port: int) -> AsyncIterator[SlowProxy]:
    p = SlowProxy(port)
    await p.start()
    try:
        yield p
    finally:
        await p.close()


# -- a sampler of every task's processes ----------------------------------------------------


def command_specs(
    stamps: Path, name: str, n: int, seconds: float, lease: float
) -> list[dict[str, Any]]:
    return [
        {
            "name": f"{name}-{i}",
            "job": {"kind": "command", "argv": shell_stamp(stamps, seconds)},
            "heartbeat_timeout_s": lease,
            "max_retries": 3,
            "backoff_base_s": 0.05,
            "backoff_cap_s": 0.1,
        }
        for i in range(n)
    ]


async def summary(pool: asyncpg.Pool, ids: list[UUID]) -> dict[str, Any]:
    rows = await pool.fetch(
        "SELECT status, attempt, retry_count, node FROM tasks WHERE id = ANY($1::uuid[])", ids
    )
    ev = await pool.fetch(
        "SELECT to_status, reason, count(*) n FROM task_events WHERE task_id = ANY($1::uuid[]) "
        "GROUP BY 1, 2 ORDER BY 1",
        ids,
    )
    return {
        "status": sorted((r["status"], r["attempt"], r["node"]) for r in rows),
        "events": [(r["to_status"], r["reason"], r["n"]) for r in ev],
    }


async def _run_slow_executor(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    service_env: dict[str, str],
    set_delay: Callable[[SlowProxy], None],
    *,
    n: int = 6,
    seconds: float = 12,
    lease: float = 10,
    a_env: dict[str, str] | None = None,
) -> tuple[dict[str, Any], Sampler, dict[UUID, Any], str]:
    async with slow_proxy(5432) as pg:
        await start_all(deployment, [], 1)
        a = await deployment.executor(
            "a",
            n,
            env={
                **FAST,
                **(a_env or {}),
                "SKED_DATABASE_URL": pg.url(service_env["SKED_DATABASE_URL"]),
            },
        )
        ids = await client.submit_many(command_specs(stamps, "slow", n, seconds, lease))

        async def all_on_a() -> bool:
            c = await pool.fetchval(
                "SELECT count(*) FROM tasks WHERE status='running' AND node='a' "
                "AND id = ANY($1::uuid[])",
                ids,
            )
            return bool(c == n)

        await eventually(all_on_a, timeout=60, what="all running on a")
        await asyncio.sleep(1.0)
        async with sampling() as sampler:
            set_delay(pg)
            await deployment.executor("b", n, env=FAST)
            try:
                done = await client.wait_all(ids, timeout=90)
            finally:
                pg.fixed(0.0)
            await asyncio.sleep(2)
        s = await summary(pool, ids)
        return s, sampler, done, a.log()


async def test_an_executor_with_300ms_to_postgres_keeps_its_leases(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    service_env: dict[str, str],
) -> None:
    """Executor a runs 6 command tasks of 12 s (heartbeat timeout 10 s, renewed every 2 s);
    then its link to Postgres gets 300 ms of latency each way and a healthy executor b joins.
    Should: a's leases are renewed (a 0.6 s round trip fits a 10 s lease many times over), and
    the tasks finish on a in attempt 1. Every renewal failed with TimeoutError, for good: a
    renewal was bounded by the renewal period (2 s), a timeout dropped the connection, and each
    next renewal had to connect afresh (about five round trips, 3 s) inside the same 2 s. The
    watchdogs froze all six, the heartbeat-monitor declared them Lost, and all six ran again
    from the start on b. Now a renewal may take what is left of the shortest lease."""
    s, sampler, done, alog = await _run_slow_executor(
        deployment,
        client,
        pool,
        stamps,
        service_env,
        lambda p: p.fixed(0.3),
        a_env={"SKED_NODE_HEARTBEAT_S": "2"},
    )
    renewals = "\n".join(x for x in alog.splitlines() if "renew" in x)[-3000:]
    assert not sampler.both, f"two attempts ran at once: {sampler.both}"
    assert all(t.status is State.SUCCESS for t in done.values()), s
    assert all(t.attempt == 1 for t in done.values()), (s["events"], renewals)


async def _lock_stall(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    dsn: str,
    lock_sql: str,
    hold_s: float,
    lease: float = 4,
    n: int = 8,
    seconds: float = 8,
) -> tuple[dict[str, Any], Sampler, dict[UUID, Any]]:
    await start_all(deployment, ["l1", "l2"], n)
    ids = await client.submit_many(command_specs(stamps, "lock", n, seconds, lease))

    async def all_running() -> bool:
        c = await pool.fetchval(
            "SELECT count(*) FROM tasks WHERE status='running' AND id = ANY($1::uuid[])", ids
        )
        return bool(c == n)

    await eventually(all_running, timeout=60, what="all running")
    async with sampling() as sampler:
        conn = await asyncpg.connect(dsn)
        try:
            tr = conn.transaction()
            await tr.start()
            try:
                await conn.execute(lock_sql, ids) if "$1" in lock_sql else await conn.execute(
                    lock_sql
                )
                await asyncio.sleep(hold_s)
            finally:
                await tr.rollback()
        finally:
            await conn.close()
        done = await client.wait_all(ids, timeout=90)
        await asyncio.sleep(2)
    return await summary(pool, ids), sampler, done


async def test_tasks_table_locked_3x_lease(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool, stamps: Path, dsn: str
) -> None:
    """8 command tasks of 8 s (heartbeat timeout 4 s) run on two healthy executors; an
    operator's session holds `LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE` for 12 s (3 x the
    lease), then rolls back. Should: as with Postgres down for as long (test_frozen.py), the
    watchdogs freeze, the leases are renewed after the stall, and the tasks thaw and finish
    in attempt 1. The heartbeat-monitor's statements just waited on the lock, with no error,
    so its rule that time executors could not renew is not held against them never fired:
    its first sweep after the release found every lease 12 s old, past the grace, and
    declared all 8 Lost, to be run again from the start. Now a sweep that Postgres kept
    waiting (STALL_S) judges nothing, and the leases that lapsed meanwhile get a timeout anew,
    as after an outage."""
    s, sampler, done = await _lock_stall(
        deployment, client, pool, stamps, dsn, "LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE", 12.0
    )
    assert not sampler.both, f"two attempts ran at once: {sampler.both}"
    assert all(t.status is State.SUCCESS for t in done.values()), s
    for p in deployment.procs:
        assert p.proc.poll() is None, p.name
    assert len(sampler.frozen) > 0  # the stall did outlast the leases: the watchdogs froze
    lost = [e for e in s["events"] if e[0] == "lost"]
    assert not lost, f"a stall of 3 x the lease made attempts Lost (re-run from scratch): {lost}"
    assert all(t.attempt == 1 for t in done.values()), s["status"]
