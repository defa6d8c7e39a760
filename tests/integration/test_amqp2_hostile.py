"""RabbitMQ doing something other than dying, round 2: the executor's probe queue and its
binding, the request/reply queues, sked.probe, sked.dead and sked.dlx changed under running
services (in the test's own vhost only), and a node queue of someone else's at start."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import aio_pika
import pytest

from services.executor.backends.local import LocalBackend
from services.executor.service import Executor
from services.heartbeat_monitor.ladder import Ladder
from shared.bus import DEAD_QUEUE, PROBE_EXCHANGE, SUBMIT_KEY, TASKS_EXCHANGE, node_queue
from shared.errors import NotFound
from shared.fsm import State
from shared.heartbeat import ProbeAnswer, Rung
from shared.settings import Settings
from shared.wiring import backends
from tests.conftest import TEST_SECRET
from tests.helpers import eventually, spec
from tests.integration.pipeline import pipeline
from tests.integration.test_amqp_hostile import _admin, _all_succeed, _declared


async def _running(client, store, name: str):  # type: ignore[no-untyped-def]
    task_id = await client.submit(spec(name, job={"kind": "command", "argv": ["sleep", "60"]}))

    async def running():  # type: ignore[no-untyped-def]
        try:
            t = await store.tasks.get(task_id)
        except NotFound:
            return None
        return t if t.status is State.RUNNING else None

    return await eventually(running, timeout=20, interval=0.2, what="the task to run")


async def test_a_deleted_probe_exchange_leaves_no_live_executor_unreachable(
    settings: Settings, tmp_path: Path
) -> None:
    """With a scheduler and an executor running an attempt, `sked.probe` is deleted (in the
    test's vhost); the monitor's next probe re-declares it (its robust channel), unbound.
    Should: like sked.dispatch (Serving.reassert), the executor binds its probe queue to
    sked.probe again within a few heartbeats, so the heartbeat-monitor's loss ladder reaches
    the live executor: an attempt whose lease lapsed briefly gets an answer and a grace, and
    its node stays ready. Nobody bound the probe queue again, and every probe came back
    UNROUTABLE for ever: the ladder marked the live node not ready and declared any overdue
    attempt on it Lost at once, without the grace a live node earns. Now Serving.reassert
    declares sked.probe and binds the probe queue again too."""
    async with pipeline(settings, tmp_path) as (store, client):
        task = await _running(client, store, "long")
        async with _admin(settings.rabbitmq_url) as ch:
            await ch.exchange_delete(PROBE_EXCHANGE)
        async with backends(settings) as m:
            ladder = Ladder(store, m.bus, 2.0, TEST_SECRET)
            last: object = None

            async def answered() -> bool:
                nonlocal last
                last = await ladder.probe(task)
                return isinstance(last, ProbeAnswer)

            # REASSERT_EVERY (5) node heartbeats of 2 s: two rounds of reassert
            with contextlib.suppress(AssertionError):
                await eventually(answered, timeout=25, interval=0.5, what="a probe answer")
            nodes = {n.id: n for n in await store.nodes.all()}
            rung, _ = await ladder.climb(task, task.heartbeat_timeout_s + 0.5, nodes)
            node = next(n for n in await store.nodes.all() if n.id == "inproc")
        assert isinstance(last, ProbeAnswer), f"the live executor never answered a probe: {last!r}"
        assert rung is Rung.GRACE, f"a live, connected node's overdue attempt got {rung}"
        assert node.ready, "the ladder marked a live, connected node not ready"


async def test_a_foreign_probe_exchange_is_named_and_closes_no_serving_channel(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Someone deletes `sked.probe` and declares it again as another type (fanout). The
    executor's re-declaration is refused (PRECONDITION_FAILED closes the channel it is made
    on): made on the serving channel, it would close the node's consumers every fifth
    heartbeat. It is made on a channel of its own (Serving.reassert), the refusal named, and
    the node goes on taking work."""
    caplog.set_level(logging.WARNING)
    fast = settings.model_copy(update={"node_heartbeat_s": 0.1})
    async with pipeline(fast, tmp_path) as (_, client):
        assert await _all_succeed(client, 1, 20) == [State.SUCCESS]
        async with _admin(settings.rabbitmq_url) as ch:
            await ch.exchange_delete(PROBE_EXCHANGE)
            await ch.declare_exchange(PROBE_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)

        async def named() -> bool:
            return any(f"exchange {PROBE_EXCHANGE}" in r.getMessage() for r in caplog.records)

        await eventually(named, timeout=15, interval=0.2, what="the foreign sked.probe named")
        assert await _all_succeed(client, 3, 20) == [State.SUCCESS] * 3


async def test_an_executor_that_starts_beside_a_foreign_node_queue_does_not_crash(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`sked.node.inproc` already exists, declared by someone else without sked's x-expires,
    when the executor of node inproc STARTS. Should: one clear line naming the queue, and the
    executor up (ready, answering probes) with its node not ready, until the queue is sked's
    (as Serving.reassert does for a running executor). Serving.sync said so and skipped the
    node, then Executor.announce took next(iter(served)) of an empty dict: the executor died
    with a traceback, and a supervisor restarted it into the same crash. Now it announces
    that it serves no node yet."""
    caplog.set_level(logging.INFO)
    node_settings = settings.model_copy(update={"node_id": "inproc", "slots": 1})
    async with _admin(settings.rabbitmq_url) as ch:
        await ch.declare_queue(node_queue("inproc"), durable=True)
    async with backends(node_settings) as e:
        backend = LocalBackend(1, tmp_path)
        executor = Executor(node_settings, e.store, e.bus, backend, e.ready_queue)
        running = asyncio.create_task(executor.run())
        ready = asyncio.create_task(executor.ready.wait())
        await asyncio.wait([running, ready], timeout=20, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(2)  # announce comes right after ready
        failure = running.exception() if running.done() else None
        nodes = {n.id: n for n in await e.store.nodes.all()}
        executor.stop()
        ready.cancel()
        _, pending = await asyncio.wait([running], timeout=30)
        for t in pending:
            t.cancel()
    said = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and node_queue("inproc") in r.getMessage()
    ]
    assert failure is None, f"the executor died on start: {failure!r}"
    assert said, "the executor never said its node queue is someone else's"
    assert "inproc" not in nodes or not nodes["inproc"].ready


async def _bad_submission(url: str) -> None:
    async with _admin(url) as ch:
        x = await ch.get_exchange(TASKS_EXCHANGE)
        await x.publish(aio_pika.Message(b"{not json", content_type="application/json"), SUBMIT_KEY)


async def _dead_count(url: str) -> int | None:
    found = await _declared(url, DEAD_QUEUE)
    return None if found is None else found.message_count


async def test_a_deleted_dead_queue_is_declared_again_and_the_refusal_parked(
    settings: Settings, tmp_path: Path
) -> None:
    """With a scheduler running, `sked.dead` is deleted (in the test's vhost), then a
    malformed submission arrives, then good ones. Should: the scheduler declares sked.dead
    (and its binding to sked.dlx) again, as it does sked.submit, sked.dispatch and node queues,
    so the refusal is parked there with its reason within a bounded time. Every dead-letter
    publish came back NO_ROUTE, and intake handed the whole batch back and retried it for
    ever: the refusal never recorded, intake's throughput a batch per backoff. Now a
    returned dead letter declares sked.dead again and is sent once more."""
    async with pipeline(settings, tmp_path) as (_, client):
        assert await _all_succeed(client, 1, 20) == [State.SUCCESS]
        async with _admin(settings.rabbitmq_url) as ch:
            await ch.queue_delete(DEAD_QUEUE)
        await _bad_submission(settings.rabbitmq_url)
        assert await _all_succeed(client, 2, 25) == [State.SUCCESS] * 2
        await eventually(
            lambda: _dead_count(settings.rabbitmq_url),
            timeout=15,
            interval=0.5,
            what="the refused submission to be parked in a declared-again sked.dead",
        )
