"""Redis silent under one service rather than down: its link cut (packets swallowed) through
tests/faults/proxy.py. Each case was found by an adversarial review, where it failed: the
docstring says what happened; the test shows it no longer does. Held up, and not kept: the
scheduler's link at 0.2-1 s latency each way through a 205-task burst; cut 20 s mid-burst and
healed (high priority first after the heal); recovery's link cut; both executors' links cut;
two schedulers, one's link at 1.5-3.5 s each way (high priority still first).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import asyncpg

from shared.client import SkedClient
from shared.queues import TIMEOUT_S
from tests.faults.checks import read_stamps, started_twice
from tests.faults.conftest import Deployment
from tests.faults.jobs import FAST, stamp_specs
from tests.faults.proxy import Proxy

REDIS = 6379


async def _proxy(cls: type[Proxy]) -> Any:
    return await cls(REDIS).start()


async def _others(deployment: Deployment, redis_url: str | None = None) -> None:
    env = dict(FAST)
    if redis_url:
        env["SKED_REDIS_URL"] = redis_url
    for name in ("relay", "recovery"):
        await deployment.start(name, env=env if name == "recovery" else FAST)
    await deployment.start("heartbeat-monitor", "--port", "0", env=FAST, ready="listening on")


async def _verdict(
    pool: asyncpg.Pool, stamps: Path, ids: list[UUID], deployment: Deployment
) -> dict[str, Any]:
    rows = await pool.fetch(
        "SELECT status, count(*) n FROM tasks WHERE id = ANY($1::uuid[]) GROUP BY 1", ids
    )
    runs = read_stamps(stamps)
    dead = [p.log_path.name for p in deployment.procs if p.proc.poll() is not None]
    return {
        "status": {r["status"]: r["n"] for r in rows},
        "twice": started_twice(runs),
        "multi": sum(len(r) > 1 for r in runs.values()),
        "dead": dead,
    }


async def _first_starts(stamps: Path) -> dict[str, float]:
    out = {}
    for tid, runs in read_stamps(stamps).items():
        if runs:
            out[tid] = min(r.start for r in runs)
    return out


async def _all_done(client: SkedClient, ids: list[UUID], timeout: float) -> tuple[bool, float]:
    t0 = time.monotonic()
    try:
        await client.wait_all(ids, timeout=timeout)
        return True, time.monotonic() - t0
    except Exception:
        return False, time.monotonic() - t0


# -- two schedulers, one's Redis link cut: the healthy one carries on -----------------------


async def test_a_scheduler_cut_from_redis_does_not_delay_the_submissions_it_consumed(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    service_env: dict[str, str],
) -> None:
    """Two schedulers, the second's link to Redis cut for the whole case; 40 submissions
    follow, 0.2 s apart, onto two idle executors. Should: the healthy scheduler carries on,
    every task starting within one Redis timeout of its submission. The cut scheduler stayed
    subscribed to sked.submit, took about half the submissions, waited out intake's Redis
    read (5 s), and handed them back to RabbitMQ, which delivered half of them to it again:
    20 of 40 started 5-38 s after their submission while a healthy scheduler sat idle. Now a
    scheduler whose intake finds Redis silent stops consuming until Redis answers a ping, and
    hands back at once what it already holds."""
    p: Proxy = await _proxy(Proxy)
    try:
        await deployment.start("scheduler", env=FAST)
        await deployment.start(
            "scheduler", env={**FAST, "SKED_REDIS_URL": p.url(service_env["SKED_REDIS_URL"])}
        )
        await _others(deployment)
        for node in ("a", "b"):
            await deployment.executor(node, 4, env=FAST)
        p.cut()
        await asyncio.sleep(1)
        submitted: dict[str, float] = {}
        for spec in stamp_specs(stamps, 40, 20):
            submitted[str(await client.submit(spec))] = time.time()
            await asyncio.sleep(0.2)
        ids = [UUID(i) for i in submitted]
        ok, _ = await _all_done(client, ids, 60)  # the cut lasts all of it
        v = await _verdict(pool, stamps, ids, deployment)
        starts = await _first_starts(stamps)
        p.heal()
        lag = sorted(round(starts[i] - submitted[i], 1) for i in submitted if i in starts)
        assert ok, f"with one scheduler cut from Redis, not all ended in 60 s: {v}"
        assert v["twice"] == 0, v
        assert not v["dead"], v
        assert lag[-1] < TIMEOUT_S + 2.0, (
            f"submission-to-start lag with a healthy scheduler beside the cut one: {lag}"
        )
    finally:
        await p.close()
