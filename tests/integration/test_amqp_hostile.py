"""RabbitMQ's topology changed under running services, in the test's own vhost only (queues
and exchanges deleted, unbound or re-declared with other arguments by someone else): the
broker tells no one, so what sked declared must come back by sked's own doing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from shared.bus import DISPATCH_EXCHANGE, SUBMIT_QUEUE, node_queue
from shared.client import SkedClient
from shared.fsm import State
from shared.settings import Settings
from tests.helpers import eventually, spec
from tests.integration.pipeline import pipeline


async def _declared(url: str, queue: str) -> Any:
    """What RabbitMQ says of `queue` (None: it does not exist), asked passively: never
    declares it."""
    conn = await aio_pika.connect(url)
    try:
        ch = await conn.channel()
        try:
            q = await ch.declare_queue(queue, passive=True)
        except aio_pika.exceptions.ChannelClosed:
            return None
        return q.declaration_result
    finally:
        await conn.close()


async def _consumers(url: str, queue: str) -> int | None:
    """How many consume `queue` (None: it does not exist)."""
    found = await _declared(url, queue)
    return None if found is None else found.consumer_count


@contextlib.asynccontextmanager
async def _admin(url: str) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    """A channel of "someone else" (an operator, another tool) on the test's own vhost."""
    conn = await aio_pika.connect(url)
    try:
        yield await conn.channel()
    finally:
        await conn.close()


async def _all_succeed(client: SkedClient, n: int, timeout: float) -> list[State]:
    ids = [await client.submit(spec(f"t{i}")) for i in range(n)]
    done = await client.wait_all(ids, timeout=timeout)
    return [t.status for t in done.values()]


async def test_a_deleted_dispatch_exchange_does_not_wedge_dispatch_for_good(
    settings: Settings, tmp_path: Path
) -> None:
    """with a scheduler and an executor running, `sked.dispatch` is deleted (in the
    test's vhost), then 3 tasks are submitted. Should: the scheduler's publish fails once,
    its robust channel re-declares `sked.dispatch`, and the executor binds its node queue to
    it again (the binding died with the exchange), so the tasks run within a bounded time.
    The exchange came back unbound; nobody re-bound `sked.node.<id>`, and every dispatch was
    returned NO_ROUTE and taken back to Ready, for ever. Now the executor declares its
    nodes' queues, sked.dispatch and their bindings again every few heartbeats
    (Serving.reassert)."""
    async with pipeline(settings, tmp_path) as (_, client):
        assert await _all_succeed(client, 1, 20) == [State.SUCCESS]
        async with _admin(settings.rabbitmq_url) as ch:
            await ch.exchange_delete(DISPATCH_EXCHANGE)
        try:
            states = await _all_succeed(client, 3, 25)
        except TimeoutError as exc:
            pytest.fail(f"tasks never ran after sked.dispatch was deleted and re-declared: {exc}")
        assert states == [State.SUCCESS] * 3


async def test_a_deleted_submit_queue_is_declared_again_by_the_scheduler(
    settings: Settings, tmp_path: Path
) -> None:
    """with a scheduler running and a producer connected (a long-lived SkedClient, as
    the API service holds), `sked.submit` is deleted; RabbitMQ cancels the scheduler's
    consumer. Should: the scheduler declares its queue (and its bindings) again and consumes
    it, so submissions are accepted again within a bounded time. The scheduler took the
    queue passively (`get_queue`), so the queue was never made again and every submission
    was refused NO_ROUTE until another process connected. Now it declares the queue and its
    bindings on its consumer channel (AmqpBus.declare_submit_queue), which its recovery
    declares again."""
    async with pipeline(settings, tmp_path) as (_, client):
        assert await _all_succeed(client, 1, 20) == [State.SUCCESS]
        async with _admin(settings.rabbitmq_url) as ch:
            await ch.queue_delete(SUBMIT_QUEUE)
        await eventually(
            lambda: _consumers(settings.rabbitmq_url, SUBMIT_QUEUE),
            timeout=15,
            interval=0.5,
            what="the scheduler to declare sked.submit again and consume it",
        )
        assert await _all_succeed(client, 2, 20) == [State.SUCCESS] * 2


async def test_a_node_queue_redeclared_with_other_arguments_is_noticed(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """while an executor consumes `sked.node.inproc`, someone deletes it and declares it
    again without sked's `x-expires` (and without its binding). RabbitMQ cancels the
    executor's consumer; aio-pika's recovery re-declares with x-expires and is refused
    PRECONDITION_FAILED, retried for ever at DEBUG level. Should: within a bounded time the
    executor says so in a clear line naming the queue, and stops offering the node
    (node not ready), so placement no longer sends it work it can never receive.
    The executor said nothing and kept the node ready; every dispatch came back NO_ROUTE and
    was taken back to Ready, for ever. Now Serving.reassert finds the queue refused, says
    why, and leaves the node (not ready) until the queue is sked's again."""
    caplog.set_level(logging.INFO)
    async with pipeline(settings, tmp_path) as (store, client):
        assert await _all_succeed(client, 1, 20) == [State.SUCCESS]
        async with _admin(settings.rabbitmq_url) as ch:
            await ch.queue_delete(node_queue("inproc"))
            await ch.declare_queue(node_queue("inproc"), durable=True)
        await client.submit(spec("stuck"))
        await asyncio.sleep(12)
        ours = [
            r
            for r in caplog.records
            if r.name.startswith(("services.executor", "shared.bus"))
            and r.levelno >= logging.WARNING
            and node_queue("inproc") in r.getMessage()
        ]
        node = next(n for n in await store.nodes.all() if n.id == "inproc")
        assert ours, "the executor never said its dispatch queue was lost or refused"
        assert not node.ready, "the node is still offered to placement without a consumer"
