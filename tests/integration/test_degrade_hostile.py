"""Degrade modes and alerting (the scheduler's evaluator, the Alertmanager poster) against
hostile node values, hostile answers and time. Each case was found by an adversarial review and
failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from uuid import uuid4

import asyncpg
import pytest
from aiohttp import web
from redis.asyncio import Redis

from services.scheduler.degrade import Degrade
from services.scheduler.hub import Hub
from shared.alerts import Alert, Alerter
from shared.queues import ReadyQueue
from shared.resilience import supervise
from shared.settings import Settings
from shared.store import Store


@pytest.fixture
async def queue(redis_url: str) -> AsyncIterator[ReadyQueue]:
    redis = Redis.from_url(redis_url)
    yield ReadyQueue(redis, 5.0)
    await redis.aclose()


async def _loop_survives(degrade: Degrade, seconds: float) -> BaseException | None:
    """Run the degrade loop as the scheduler does (under `supervise`) for `seconds`; the
    exception that ended it, or None if it was still running."""
    stop = asyncio.Event()
    task = asyncio.create_task(supervise("degrade", lambda: degrade.run(stop), stop))
    await asyncio.sleep(seconds)
    failure = task.exception() if task.done() else None
    stop.set()
    with contextlib.suppress(BaseException):
        async with asyncio.timeout(5):
            await task
    return failure


async def test_large_gpu_counts_overflow_the_snapshot_and_stop_the_scheduler(
    store: Store, settings: Settings, queue: ReadyQueue
) -> None:
    """Two executors started with SKED_NODE_GPU=2147483647 (the largest value the setting
    accepts, `le=2**31 - 1`; or e.g. three with 1e9 each) make `degrade_snapshot`'s
    `COALESCE(sum(gpu), 0)::int` overflow: Postgres raises "integer out of range", a
    non-transient DataError, out of `Degrade.evaluate`. `supervise` re-raises it, the
    scheduler's task group ends and every scheduler replica stops — the whole cluster stops
    dispatching because of a node's GPU count.

    Now degrade_snapshot's sums and counts are bigint."""
    big = 2**31 - 1
    Settings(
        database_url=settings.database_url,
        rabbitmq_url=settings.rabbitmq_url,
        redis_url=settings.redis_url,
        heartbeat_secret=settings.heartbeat_secret,
        node_gpu=big,
    )  # the executor's setting accepts it
    for name in ("gpu-big-a", "gpu-big-b"):
        await store.nodes.register(name, 4, 4.0, 1024, big, {}, uuid4())
    s = settings.model_copy(update={"degrade_check_s": 0.05})
    degrade = Degrade(s, store, queue, Hub(), None, Alerter(None, None))
    failure = await _loop_survives(degrade, 1.0)
    assert failure is None, f"the degrade loop (and so the scheduler) died: {failure!r}"


async def test_an_alertmanager_error_page_is_read_whole(unused_tcp_port: int) -> None:
    """`Alerter._post` logs the first 300 bytes of a refusal's body, but reads the body whole
    first (`(await resp.read())[:300]`): an Alertmanager (or a proxy in front of it, or
    whatever SKED_ALERTMANAGER_URL points at) answering 500 with a huge body makes every
    scheduler, recovery and CLI buffer it all in memory, within POST_TIMEOUT_S — hundreds of
    MB a post on loopback, at every alert batch. Unbounded memory from a remote's answer.

    Now only the 300 bytes logged are read (`resp.content.read(300)`)."""
    sent = 0
    chunk = b"x" * (1 << 20)
    total_mb = 256

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        await request.read()
        resp = web.StreamResponse(status=500)
        resp.content_length = total_mb * len(chunk)
        await resp.prepare(request)
        try:
            for _ in range(total_mb):
                await resp.write(chunk)
                sent += len(chunk)
        except (ConnectionError, OSError):
            pass
        return resp

    app = web.Application()
    app.router.add_post("/api/v2/alerts", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", unused_tcp_port)
    await site.start()
    alerter = Alerter(None, f"http://127.0.0.1:{unused_tcp_port}")
    try:
        async with asyncio.timeout(20):
            alert = Alert("SkedNodeLost", "warning", "x", labels={"node": "n"})
            await alerter.send([alert], datetime.now(UTC))
            await alerter.flush(timeout=10)
            await asyncio.sleep(0.5)
    finally:
        await alerter.close()
        await runner.cleanup()
    assert sent < 16 * len(chunk), (
        f"the poster read {sent >> 20} MB of an error page to log 300 bytes"
    )


class Recording(Alerter):
    def __init__(self) -> None:
        super().__init__(None, None)
        self.sent: list[Alert] = []

    async def send(self, alerts, now):  # type: ignore[no-untyped-def]
        self.sent.extend(alerts)


async def test_a_node_dead_past_the_seen_window_has_its_lost_alert_resolved(
    store: Store, settings: Settings, queue: ReadyQueue, pool: asyncpg.Pool
) -> None:
    """SkedNodeLost is documented as "resolved when it is healthy again". The evaluator
    derives it from `snapshot.unhealthy`, which only lists nodes seen within
    SKED_DEGRADE_NODES_SEEN_S (1 h): once a dead node's last heartbeat is older than that, it
    drops out of the list and `Degrade.watch` sends a *resolve* ("node X is back") although
    the node never came back. An hour into an outage the page clears itself and the operator
    is told the node recovered.

    Now degrade_snapshot tells, of the nodes the evaluator holds lost, those healthy again
    and those that left cleanly or were forgotten; only those are resolved, each saying which,
    and a node merely aged out of the window stays lost."""
    await store.nodes.register("dead-node", 2, 2.0, 1024, 0, {}, uuid4())
    await store.nodes.register("live-node", 2, 2.0, 1024, 0, {}, uuid4())
    alerter = Recording()
    degrade = Degrade(settings, store, queue, Hub(), None, alerter)
    await pool.execute(
        "UPDATE nodes SET heartbeat_at = now() - interval '10 minutes' WHERE id = 'dead-node'"
    )
    await degrade.evaluate()
    fired = [a for a in alerter.sent if a.name == "SkedNodeLost" and not a.resolved]
    assert [a.labels["node"] for a in fired] == ["dead-node"]
    alerter.sent.clear()
    # still dead, one more hour of silence: nothing about it changed but its age
    await pool.execute(
        "UPDATE nodes SET heartbeat_at = now() - interval '2 hours' WHERE id = 'dead-node'"
    )
    await degrade.evaluate()
    resolved = [a for a in alerter.sent if a.name == "SkedNodeLost" and a.resolved]
    assert not resolved, (
        f"SkedNodeLost resolved for a node that is still dead: {[a.summary for a in resolved]}"
    )

    await pool.execute("UPDATE nodes SET heartbeat_at = now() WHERE id = 'dead-node'")
    await degrade.evaluate()
    resolved = [a for a in alerter.sent if a.name == "SkedNodeLost" and a.resolved]
    assert [a.summary for a in resolved] == ["node dead-node is back"]
    alerter.sent.clear()
    await pool.execute(
        "UPDATE nodes SET heartbeat_at = now() - interval '10 minutes' WHERE id = 'live-node'"
    )
    await degrade.evaluate()
    await pool.execute("UPDATE nodes SET left_at = now() WHERE id = 'live-node'")
    await degrade.evaluate()
    summaries = [a.summary for a in alerter.sent if a.name == "SkedNodeLost"]
    assert summaries == [
        "node live-node is not healthy",
        "node live-node has left (stopped cleanly, or forgotten)",
    ]
