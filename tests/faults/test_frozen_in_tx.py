"""A service frozen (SIGSTOP: a paused VM or container, a swap storm) while it sits inside a
Postgres transaction. Each case was found by an adversarial review, where it failed: the
docstrings say what happened; each test shows it no longer does. Its own timeouts are counted
by the frozen process; Postgres's idle_in_transaction_session_timeout (shared/wiring.py) is
what ends the transaction."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
from pathlib import Path

import asyncpg
import pytest

from shared.client import SkedClient
from tests.faults.conftest import Deployment
from tests.faults.jobs import FAST
from tests.helpers import ServiceProcess, eventually


def _tree(pid: int) -> set[int]:
    """`pid` and its descendants."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo.extend(kids.get(p, []))
    return out


def _local_ports(pid: int) -> set[int]:
    """The local TCP ports of the sockets the process tree of `pid` holds."""
    inodes: set[str] = set()
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{p}/fd/{fd}")
                    if m := re.fullmatch(r"socket:\[(\d+)\]", link):
                        inodes.add(m.group(1))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


async def freeze_inside_transaction(
    proc: ServiceProcess, pool: asyncpg.Pool, app: str, locking: str, tries: int = 300
) -> int:
    """SIGSTOP `proc` again and again until it is caught with one of its Postgres sessions
    "idle in transaction" (its transaction open, its process stopped) holding a lock on table
    `locking`; returns that backend's pid, the process left stopped. Bounded: `tries`."""
    for _ in range(tries):
        proc.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(0.15)  # what it had sent is run to its end by Postgres
        ports = _local_ports(proc.proc.pid)
        row = await pool.fetchrow(
            "SELECT pid, client_port FROM pg_stat_activity WHERE application_name = $1 "
            "AND state = 'idle in transaction' AND client_port = ANY($2::int[]) AND EXISTS ("
            "SELECT 1 FROM pg_locks l WHERE l.pid = pg_stat_activity.pid "
            "AND l.relation = $3::regclass)",
            app,
            list(ports),
            locking,
        )
        if row is not None:
            return int(row["pid"])
        proc.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(random.uniform(0.0, 0.03))
    # never a skip: a case that could not freeze its service where it means to proves nothing
    pytest.fail(f"{app} never caught inside a transaction in {tries} freezes")


async def test_a_frozen_relay_holds_every_shard_for_as_long_as_it_is_frozen(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    """Two relays share the outbox by shard. One relay is SIGSTOPped inside its pass: its
    transaction holds `outbox_shards` rows FOR UPDATE (usually every shard) while it waits
    for RabbitMQ's confirms. Its backend sat "idle in transaction" for the whole freeze, so
    the other relay found no free shard (`lock_free_shards`, SKIP LOCKED) and no event of
    any task was published for as long as the freeze lasted, a healthy relay running: the
    relay's own bound on a pass (the confirm timeout, monotonic) is counted by the frozen
    process. Now Postgres ends a relay's transaction left idle past the confirm timeout and
    half the node TTL, and the healthy relay publishes the events (at least once: the frozen
    one's publishes, if it wakes, are duplicates, which consumers tolerate)."""
    await deployment.start("scheduler", env=FAST)
    await deployment.start("recovery", env=FAST)
    frozen = await deployment.start("relay", env=FAST)
    await deployment.start("relay", env=FAST)
    await deployment.executor("n1", 4, env=FAST)

    stop_load = asyncio.Event()

    async def load() -> None:  # events keep flowing, so that the relays pass and pass again
        i = 0
        while not stop_load.is_set():
            await client.submit({"name": f"load-{i}", "job": {"kind": "command", "argv": ["true"]}})
            i += 1
            await asyncio.sleep(0.01)

    loader = asyncio.create_task(load())
    try:
        backend = await freeze_inside_transaction(frozen, pool, "sked-relay", "outbox_shards")
    finally:
        stop_load.set()
        await loader
    try:
        task_id = await client.submit(
            {"name": "after-the-freeze", "job": {"kind": "command", "argv": ["true"]}}
        )
        await client.wait(task_id, timeout=30)

        async def published() -> bool:
            n = await pool.fetchval("SELECT count(*) FROM outbox WHERE task_id = $1", task_id)
            return n == 0

        try:
            await eventually(published, timeout=20, what="the new task's events published")
        except AssertionError:
            state = await pool.fetchval(
                "SELECT state FROM pg_stat_activity WHERE pid = $1", backend
            )
            left = await pool.fetchval("SELECT count(*) FROM outbox")
            pytest.fail(
                f"20 s after the task ended its events are still in the outbox ({left} rows "
                f"in all): the other relay is locked out by the frozen one, whose backend is "
                f"{state!r}"
            )
    finally:
        frozen.proc.send_signal(signal.SIGCONT)


async def test_a_frozen_scheduler_stops_every_replica_and_the_node_heartbeats(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    """Two schedulers. One is SIGSTOPped inside a dispatch pass, after `sked_nodes` locked
    the live node rows FOR UPDATE and before its COMMIT (the pass pops Redis, reads and CASes
    in between). Its backend sat "idle in transaction" holding the node rows for the whole
    freeze, so the other scheduler's passes and intake's placements waited on those locks,
    and so did every executor's node heartbeat (`node_heartbeat` updates the row): no attempt
    started anywhere, and the node's `heartbeat_at` went stale past the node TTL, so the
    cluster judged a healthy node dead (placement, the degrade triggers, SkedNodeLost), for
    as long as one replica was frozen. Now Postgres ends the frozen replica's transaction
    after half the node TTL idle; the node keeps beating within its TTL and the healthy
    scheduler goes on placing the line."""
    await deployment.start("scheduler", env=FAST)
    frozen = deployment.procs[-1]
    await deployment.start("scheduler", env=FAST)
    await deployment.start("recovery", env=FAST)
    await deployment.start("relay", env=FAST)
    await deployment.executor("n1", 1, env=FAST)

    stop_load = asyncio.Event()

    async def load() -> None:  # a line that the single slot drains: passes run and run again
        i = 0
        while not stop_load.is_set():
            await client.submit_many(
                [
                    {"name": f"load-{i}-{j}", "job": {"kind": "command", "argv": ["true"]}}
                    for j in range(5)
                ]
            )
            i += 1
            await asyncio.sleep(0.05)

    loader = asyncio.create_task(load())
    try:
        await freeze_inside_transaction(frozen, pool, "sked-scheduler", "nodes")
    finally:
        stop_load.set()
        await loader
    try:
        frozen_at = await pool.fetchval("SELECT now()")

        async def progress() -> tuple[float, int]:
            """The age of n1's heartbeat (Postgres's clock), and how many attempts started
            since the freeze."""
            row = await pool.fetchrow(
                "SELECT (SELECT extract(epoch FROM now() - heartbeat_at)::float8 FROM nodes "
                "WHERE id = 'n1') AS age, (SELECT count(*) FROM tasks WHERE started_at > $1) "
                "AS started",
                frozen_at,
            )
            assert row is not None
            return row["age"], row["started"]

        # 15 s: past the node TTL (10 s); the executor beats every 0.5 s (FAST)
        worst, started = 0.0, 0
        for _ in range(30):
            await asyncio.sleep(0.5)
            age, started = await progress()
            worst = max(worst, age)
        waiting = await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        )
        said = (
            f"with one scheduler replica frozen for 15 s: node n1's heartbeat went {worst:.1f} s "
            f"stale (TTL 10 s: judged dead), {started} attempt(s) started cluster-wide, "
            f"{waiting} session(s) waiting on a lock"
        )
        assert worst < 10.0, said
        assert started > 0, said
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
