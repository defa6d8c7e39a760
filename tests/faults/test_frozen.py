"""At most one live attempt when an executor is frozen (SIGSTOP) or cut off from Postgres and
RabbitMQ, and no loss when Postgres is away for everyone.

A sampler reads /proc every 0.2 s: which processes carry the task's SKED_TASK_ID, of which
attempt, and whether they run (any state but T stopped, Z zombie). At no sample may two
attempts of one task have a running process. A frozen executor's attempt is frozen by its
node's watchdog (state T) before the heartbeat-monitor may declare it Lost, and killed when
its executor learns the task moved on.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import asyncpg
import pytest

from shared.client import SkedClient
from shared.fsm import State
from tests.e2e.checks import check_all_histories
from tests.faults.checks import (
    Sampler,
    duplicated,
    overlap_s,
    read_stamps,
    sampling,
    started_twice,
    task_processes,
)
from tests.faults.conftest import Deployment, Row
from tests.faults.jobs import FAST, shell_stamp, start_all
from tests.faults.proxy import Proxy
from tests.faults.test_outages import _pg_version, run, wait_port
from tests.helpers import ServiceProcess, eventually

TIMEOUT = 3.0  # heartbeat timeout = lease of the attempts under test


async def one_long_task(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool, stamps: Path, **env: str
) -> tuple[UUID, ServiceProcess]:
    """The deployment, with executor `a` (its env: `env`) running one 30 s task; then `b`."""
    await start_all(deployment, [], 1)
    a = await deployment.executor("a", 1, env={**FAST, **env})
    task_id = await client.submit(
        {
            "name": "thirty-seconds",
            "job": {"kind": "command", "argv": shell_stamp(stamps, 30)},
            "heartbeat_timeout_s": TIMEOUT,
            "max_retries": 2,
            "backoff_base_s": 0.05,
            "backoff_cap_s": 0.1,
        }
    )

    async def running_on_a() -> bool:
        row = await pool.fetchrow("SELECT status, node FROM tasks WHERE id = $1", task_id)
        return row is not None and (row["status"], row["node"]) == ("running", "a")

    await eventually(running_on_a, timeout=60, what="the task running on a")
    await deployment.executor("b", 1, env=FAST)
    return task_id, a


async def second_attempt_started(pool: asyncpg.Pool, task_id: UUID) -> float:
    async def started() -> Any:
        return await pool.fetchval(
            "SELECT started_at FROM tasks WHERE id = $1 AND attempt = 2 AND status = 'running'",
            task_id,
        )

    return float((await eventually(started, timeout=60, what="attempt 2 running")).timestamp())


async def check_one_live_attempt(
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    sampler: Sampler,
    task_id: UUID,
    record: list[Row],
    case: str,
    recovery_s: float,
) -> None:
    done = await client.wait(task_id, timeout=90)
    runs = read_stamps(stamps)
    lost = int(done.status is not State.SUCCESS)
    dup = started_twice(runs)
    # attempt 1 never stamped its end: it was frozen, then killed; the sampler saw how long
    # two attempts had running processes
    [ended] = [r for rs in runs.values() for r in rs if r.attempt == 2]
    assert ended.end is not None
    both = sum(sampler.both.values())
    seen, frozen = sampler.seen.get(str(task_id), set()), sampler.frozen.get(str(task_id), set())
    print(
        f"\n{case}: attempt 2 started {recovery_s:.2f} s after the fault; {sampler.samples} "
        f"samples, two attempts running for {both:.1f} s, attempts seen frozen "
        f"{sorted(frozen)}; stamps {runs}"
    )
    record.append(Row(case, 1, lost, dup, recovery_s, both))
    assert sampler.samples > 50
    assert both == 0.0
    assert seen == {1, 2}
    # the watchdog, not a kill, stopped the first attempt: its processes were seen in state T
    first_attempt = min(seen)
    assert first_attempt in frozen, (
        f"attempt {first_attempt} was never seen frozen (seen frozen: {frozen})"
    )
    assert done.status is State.SUCCESS
    assert done.attempt == 2
    assert dup == 0
    # attempt 1's outcome (killed once its executor heard the task moved on) is kept, not used
    late = await pool.fetch("SELECT attempt, ok FROM late_results WHERE task_id = $1", task_id)
    assert [(r["attempt"], r["ok"]) for r in late] == [(1, False)]
    await check_all_histories(pool)


async def test_a_frozen_executor_never_runs_an_attempt_beside_its_successor(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
) -> None:
    task_id, a = await one_long_task(deployment, client, pool, stamps)
    async with sampling(task_id) as sampler:
        frozen_at = time.time()
        a.proc.send_signal(signal.SIGSTOP)
        try:
            recovery_s = await second_attempt_started(pool, task_id) - frozen_at
            await asyncio.sleep(max(0.0, frozen_at + 15 - time.time()))
        finally:
            a.proc.send_signal(signal.SIGCONT)
        await a.wait_for_log(f"stopped {task_id} attempt 1", timeout=30)
    await check_one_live_attempt(
        client, pool, stamps, sampler, task_id, record, "executor frozen 15 s (SIGSTOP)", recovery_s
    )
    assert a.proc.poll() is None  # it came back and kept running
    # Lost no sooner than the lease (timeout) plus the margin after the freeze
    assert recovery_s > TIMEOUT


async def test_an_executor_cut_off_from_postgres_and_rabbitmq(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
    service_env: dict[str, str],
) -> None:
    pg, amqp = await Proxy(5432).start(), await Proxy(5672).start()
    try:
        env = {
            "SKED_DATABASE_URL": pg.url(service_env["SKED_DATABASE_URL"]),
            "SKED_RABBITMQ_URL": amqp.url(service_env["SKED_RABBITMQ_URL"]),
        }
        task_id, a = await one_long_task(deployment, client, pool, stamps, **env)
        async with sampling(task_id) as sampler:
            cut_at = time.time()
            pg.cut()
            amqp.cut()
            try:
                recovery_s = await second_attempt_started(pool, task_id) - cut_at
                await asyncio.sleep(max(0.0, cut_at + 15 - time.time()))
            finally:
                pg.heal()
                amqp.heal()
            await a.wait_for_log(f"stopped {task_id} attempt 1", timeout=60)
        await check_one_live_attempt(
            client,
            pool,
            stamps,
            sampler,
            task_id,
            record,
            "executor cut off from Postgres and RabbitMQ 15 s",
            recovery_s,
        )
        assert a.proc.poll() is None
    finally:
        await pg.close()
        await amqp.close()


@pytest.fixture
def restores_postgres() -> Any:
    yield
    if not _port_open(5432):
        run("pg_ctlcluster", "--skip-systemctl-redirect", _pg_version(), "main", "start")


def _port_open(port: int) -> bool:
    import socket

    with contextlib.closing(socket.socket()) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_a_postgres_outage_longer_than_the_lease_loses_nothing(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
    restores_postgres: None,
) -> None:
    """Postgres down for 3 x the heartbeat timeout while 20 tasks run: their executors cannot
    renew, so the watchdogs freeze them; after the outage the leases are renewed, the tasks
    thaw and finish. None Lost, none retried, all Success."""
    await start_all(deployment, ["o1", "o2"], 10)
    specs = [
        {
            "name": f"rides-out-{i}",
            "job": {"kind": "command", "argv": shell_stamp(stamps, 12)},
            "heartbeat_timeout_s": TIMEOUT,
            "max_retries": 2,
        }
        for i in range(20)
    ]
    ids = await client.submit_many(specs)

    async def all_running() -> bool:
        n = await pool.fetchval(
            "SELECT count(*) FROM tasks WHERE status = 'running' AND id = ANY($1::uuid[])", ids
        )
        return bool(n == 20)

    await eventually(all_running, timeout=60, what="20 tasks running")
    version = _pg_version()
    started = time.monotonic()
    run("pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "stop", "-m", "fast")
    await wait_port(5432, up=False, timeout=60)
    await asyncio.sleep(max(0.0, started + 3 * TIMEOUT - time.monotonic()))
    procs = await asyncio.to_thread(task_processes)
    frozen = {p for i in ids for p in procs.get(str(i), {}).get(1, [])}
    run("pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start")
    await wait_port(5432, up=True, timeout=60)
    outage = time.monotonic() - started
    await pool.expire_connections()
    done = await client.wait_all(ids, timeout=120)
    finished = time.monotonic()
    lost = sum(t.status is not State.SUCCESS for t in done.values())
    runs = read_stamps(stamps)
    events = await pool.fetch(
        "SELECT to_status, count(*) AS n FROM task_events WHERE task_id = ANY($1::uuid[]) "
        "GROUP BY to_status",
        ids,
    )
    by_state = {r["to_status"]: r["n"] for r in events}
    print(
        f"\nPostgres down {outage:.1f} s (lease {TIMEOUT:g} s): attempt-1 process states during "
        f"the outage {sorted(frozen)}; all done {finished - started - outage:.1f} s after it"
    )
    record.append(
        Row(
            f"Postgres down {outage:.0f} s (3 x lease) under 20 running",
            20,
            lost,
            duplicated(runs),
            finished - started - outage,
            overlap_s(runs),
        )
    )
    assert "T" in frozen, "the watchdogs did not freeze the attempts during the outage"
    assert lost == 0
    assert all(t.attempt == 1 and t.retry_count == 0 for t in done.values())
    assert "lost" not in by_state
    assert "retry_wait" not in by_state
    assert duplicated(runs) == 0
    await check_all_histories(pool)
    for proc in deployment.procs:
        assert proc.proc.poll() is None, f"{proc.name} exited during the outage:\n{proc.log()}"
