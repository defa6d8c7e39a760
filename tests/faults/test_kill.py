"""SIGKILL the services, one at a time and at random moments: nothing lost, nothing run twice."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import asyncpg

from shared.client import SkedClient
from shared.fsm import State
from tests.e2e.checks import check_all_histories
from tests.faults.checks import duplicated, overlap_s, read_stamps
from tests.faults.conftest import Deployment, Row
from tests.faults.jobs import FAST, cut_short_specs, stamp_specs, start_all
from tests.helpers import eventually


async def running_on(pool: asyncpg.Pool, node: str, attempt: int) -> int:
    return await pool.fetchval(
        "SELECT count(*) FROM tasks WHERE status = 'running' AND node = $1 AND attempt = $2",
        node,
        attempt,
    )


async def test_sigkill_an_executor_with_fifty_running_tasks(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
) -> None:
    timeout = 2.0
    doomed = (await start_all(deployment, ["doomed"], 50))["doomed"]
    # attempt 1 outlasts any slow start of the survivor: it can only end by the kill
    ids = await client.submit_many(cut_short_specs(stamps, "three-seconds", 50, 3, timeout, 2))

    async def all_running() -> bool:
        return await running_on(pool, "doomed", 1) == 50

    await eventually(all_running, timeout=60, what="50 tasks running on the doomed node")
    await deployment.executor("survivor", 50, env=FAST)
    killed_at = time.time()
    doomed.kill()

    async def all_back() -> bool:
        return await running_on(pool, "survivor", 2) == 50

    await eventually(all_back, timeout=60, what="all 50 re-running on the survivor")
    rerun = await pool.fetchval("SELECT max(started_at) FROM tasks WHERE id = ANY($1::uuid[])", ids)
    recovery_s = rerun.timestamp() - killed_at
    print(
        f"\nexecutor SIGKILL: kill -> all 50 re-running in {recovery_s:.2f} s "
        f"(heartbeat timeout {timeout:g} s)"
    )
    done = await client.wait_all(ids, timeout=60)
    lost = sum(t.status is not State.SUCCESS for t in done.values())
    dup = duplicated(read_stamps(stamps), killed_at)
    over = overlap_s(read_stamps(stamps), killed_at)
    record.append(Row("SIGKILL executor, 50 x 3 s tasks running", 50, lost, dup, recovery_s, over))
    assert lost == 0
    assert dup == 0
    assert all(t.attempt == 2 and t.node == "survivor" for t in done.values())
    await check_all_histories(pool)
    reasons = await pool.fetch(
        "SELECT reason FROM task_events WHERE to_status = 'lost' AND task_id = ANY($1::uuid[])",
        ids,
    )
    assert len(reasons) == 50
    assert all("node doomed gone" in r["reason"] for r in reasons), reasons[0]
    assert recovery_s <= timeout + 2.0, f"recovery took {recovery_s:.2f} s"


async def test_sigkill_an_executor_holding_a_backlog(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
) -> None:
    """SKED_PREFETCH: the doomed node runs 4 attempts and holds 4 dispatches unstarted when it
    is killed. The running ones are Lost and retried; the held ones, never started, come back
    from Scheduling by the stuck sweep; every task succeeds once, none overlaps itself."""
    await start_all(deployment, [], 0)
    doomed = await deployment.executor("doomed", 4, env={**FAST, "SKED_PREFETCH": "4"})
    ids = await client.submit_many(cut_short_specs(stamps, "backlog", 8, 1, 2.0, 2))

    async def four_and_four() -> bool:
        rows = await pool.fetch(
            "SELECT status, count(*) AS n FROM tasks WHERE node = 'doomed' GROUP BY status"
        )
        return {r["status"]: r["n"] for r in rows} == {"running": 4, "scheduling": 4}

    await eventually(four_and_four, timeout=60, what="4 running and 4 held on the doomed node")
    await deployment.executor("survivor", 8, env=FAST)
    killed_at = time.time()
    doomed.kill()
    done = await client.wait_all(ids, timeout=90)
    rerun = max(t.started_at.timestamp() for t in done.values() if t.started_at is not None)
    lost = sum(t.status is not State.SUCCESS for t in done.values())
    dup = duplicated(read_stamps(stamps), killed_at)
    over = overlap_s(read_stamps(stamps), killed_at)
    case = "SIGKILL executor holding a backlog (4 run, 4 held)"
    record.append(Row(case, 8, lost, dup, rerun - killed_at, over))
    assert lost == 0
    assert dup == 0
    assert all(t.node == "survivor" for t in done.values())
    await check_all_histories(pool)


async def test_sigkill_each_service_at_random_moments(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
) -> None:
    rnd = random.Random()
    procs = await start_all(deployment, ["k1", "k2"], 8)
    specs = stamp_specs(
        stamps, 1000, 30, heartbeat_timeout_s=3.0, max_retries=2, backoff_base_s=0.05
    )
    ids = await client.submit_many(specs)
    kills = []
    for name in ("scheduler", "relay", "heartbeat-monitor", "recovery"):
        await asyncio.sleep(rnd.uniform(0.2, 1.0))
        procs[name].kill()
        kills.append((name, time.time()))
        args = ("--port", "0") if name == "heartbeat-monitor" else ()
        ready = "listening on" if name == "heartbeat-monitor" else None
        procs[name] = await deployment.start(name, *args, env=FAST, ready=ready)
    print(f"\nkilled and restarted: {[k for k, _ in kills]}")
    done = await client.wait_all(ids, timeout=180)
    lost = sum(t.status is not State.SUCCESS for t in done.values())
    runs = read_stamps(stamps)
    dup = duplicated(runs)
    record.append(
        Row(
            "SIGKILL scheduler, relay, monitor, recovery mid-run",
            1000,
            lost,
            dup,
            None,
            overlap_s(runs),
        )
    )
    assert lost == 0
    assert dup == 0
    assert len(runs) == 1000
    await check_all_histories(pool)
    unpublished = await pool.fetchval("SELECT count(*) FROM outbox")

    async def outbox_drained() -> bool:
        return not await pool.fetchval("SELECT count(*) FROM outbox")

    await eventually(outbox_drained, timeout=30, what=f"{unpublished} events to be relayed")
