"""The outbox relay and sked.events against a hostile world: cases found by an adversarial review.

Each test failed on the code as it was then; each docstring says what that code did. Real
Postgres and RabbitMQ (this test's private vhost); the only thing in between is a TCP proxy of
the test's own that can freeze one relay's link to the broker (a partition, a frozen broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit
from uuid import UUID

import aio_pika
import asyncpg
import pytest

from services.relay.service import Relay
from shared import fsm
from shared import relay as relay_module
from shared.bus import EVENTS_EXCHANGE, AmqpBus, Outgoing
from shared.fsm import State
from shared.models import EventMessage
from shared.outbox_pack import pack
from shared.relay import OutboxRelay, _body
from shared.settings import Settings
from shared.store import Store
from tests.helpers import eventually, spec

# --------------------------------------------------------------------------------------------
# helpers


class FreezableProxy:
    """A TCP proxy to RabbitMQ; `frozen` stops forwarding in both directions (bytes are held,
    the sockets stay open): the peer sees a silent partition, as with a frozen broker."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.frozen = asyncio.Event()
        self.thawed = asyncio.Event()
        self.thawed.set()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    def freeze(self) -> None:
        self.thawed.clear()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await src.read(65536):
                await self.thawed.wait()
                dst.write(data)
                await dst.drain()
        with contextlib.suppress(Exception):
            dst.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(self.host, self.port)
        self._writers += [writer, up_w]
        for a, b in ((reader, up_w), (up_r, writer)):
            t = asyncio.create_task(self._pipe(a, b))
            self._pipes.add(t)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in self._pipes:
            t.cancel()
        for w in self._writers:
            with contextlib.suppress(Exception):
                w.close()


@contextlib.asynccontextmanager
async def proxied(url: str) -> AsyncIterator[tuple[str, FreezableProxy]]:
    parts = urlsplit(url)
    proxy = FreezableProxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    port = await proxy.start()
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    try:
        yield urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{port}")), proxy
    finally:
        await proxy.close()


async def unpublished(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM outbox")


async def make_events(store: Store, n: int, prefix: str) -> None:
    """n tasks, each moved to Pending then Ready: a few events each in the outbox."""
    tasks = await store.tasks.create_many([spec(f"{prefix}{i}") for i in range(n)])
    for task in tasks:
        for target in (State.PENDING, State.READY):
            if task.status is not target:
                task = await fsm.apply(store.tasks, task, target)


class Sink:
    """A well-behaved subscriber of sked.events: (task_id, version) in arrival order."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[UUID, int]] = []

    async def consume(self, url: str, ready: asyncio.Event) -> None:
        connection = await aio_pika.connect_robust(url)
        async with connection:
            channel = await connection.channel()
            exchange = await channel.declare_exchange(
                EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
            )
            queue = await channel.declare_queue(exclusive=True)
            await queue.bind(exchange, "task.#")
            ready.set()
            async with queue.iterator() as messages:
                async for message in messages:
                    async with message.process():
                        body = EventMessage.model_validate_json(message.body)
                        self.arrivals += [(e.task_id, e.version) for e in body.events]


@contextlib.asynccontextmanager
async def sink_on(url: str) -> AsyncIterator[Sink]:
    s = Sink()
    ready = asyncio.Event()
    task = asyncio.create_task(s.consume(url, ready))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        yield s
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(task, 10)


# --------------------------------------------------------------------------------------------
# 1. a relay whose broker link freezes holds every shard: no other relay can take over


async def test_a_relay_with_a_frozen_broker_link_does_not_hold_every_other_relay_off(
    settings: Settings, store: Store, pool: asyncpg.Pool
) -> None:
    """Any number of relays may run, sharing the work by shard. Relay A locks all 16 shards, then
    publishes; its link to RabbitMQ freezes (partition, frozen broker, or a resource alarm,
    which blocks publishers the same way while heartbeats flow). Its publish waited for
    confirms with no timeout, inside the transaction that holds the shards: relay B, with a
    healthy link, found every shard locked and relayed nothing — the whole event stream stopped
    for as long as A's pass hung (until AMQP heartbeats noticed, ~1-3 min; for ever under an
    alarm). Now A's pass gives up after CONFIRM_TIMEOUT_S and rolls back."""
    await make_events(store, 20, "frozen")
    before = await unpublished(pool)
    assert before > 0
    async with proxied(settings.rabbitmq_url) as (url, proxy):
        bus_a = AmqpBus(url)
        await bus_a.connect()
        bus_b = AmqpBus(settings.rabbitmq_url)
        await bus_b.connect()
        relay_a = OutboxRelay(store, bus_a, 100)
        relay_b = OutboxRelay(store, bus_b, 100)
        proxy.freeze()
        pass_a = asyncio.create_task(relay_a.run_once())
        try:
            await asyncio.sleep(1.0)  # A has locked the shards and is waiting for confirms
            assert not pass_a.done(), pass_a
            deadline = asyncio.get_running_loop().time() + 20
            sent_by_b = 0
            while asyncio.get_running_loop().time() < deadline:
                sent_by_b += await asyncio.wait_for(relay_b.drain(), 10)
                if await unpublished(pool) == 0:
                    break
                await asyncio.sleep(0.5)
            left = await unpublished(pool)
            assert left == 0, (
                f"20 s after relay A's link froze, relay B (healthy) relayed {sent_by_b} events;"
                f" {left} of {before} still unpublished; relay A's pass done: {pass_a.done()}"
            )
        finally:
            await cancel(pass_a)
            proxy.thawed.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(bus_a.close(), 5)
            await bus_b.close()


async def test_a_relay_stops_on_request_while_its_broker_link_is_frozen(
    settings: Settings, store: Store, pool: asyncpg.Pool
) -> None:
    """SIGTERM (Relay.stop) during a pass whose publish confirms never come: the relay's
    loop checked `stopping` only between passes and the publish had no timeout, so the service
    did not stop — an orchestrator had to SIGKILL it. Now the pass is cancelled (its
    transaction rolls back): the relay stops at once, well before CONFIRM_TIMEOUT_S."""
    await make_events(store, 5, "stop")
    before = await unpublished(pool)
    async with proxied(settings.rabbitmq_url) as (url, proxy):
        bus = AmqpBus(url)
        await bus.connect()
        relay = Relay(settings.model_copy(update={"relay_batch": 100}), store, bus)
        proxy.freeze()
        runner = asyncio.create_task(relay.run())
        try:
            await asyncio.wait_for(relay.ready.wait(), 10)
            await asyncio.sleep(1.0)  # its first pass is publishing into the frozen link
            relay.stop()
            done, _ = await asyncio.wait({runner}, timeout=3)
            assert done, "the relay did not stop within 3 s of stop() (publish hung)"
            assert runner.exception() is None
            assert await unpublished(pool) == before, "the cancelled pass did not roll back"
        finally:
            await cancel(runner)
            proxy.thawed.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(bus.close(), 5)


# --------------------------------------------------------------------------------------------
# 2. one subscriber's queue that refuses publishes (nack) stalled and duplicated the stream


async def bounded_queue(
    channel: aio_pika.abc.AbstractChannel, name: str, arguments: dict[str, Any]
) -> aio_pika.abc.AbstractQueue:
    exchange = await channel.declare_exchange(
        EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
    )
    arguments = {**arguments, "x-overflow": "reject-publish"}
    queue = await channel.declare_queue(name, arguments=arguments)
    await queue.bind(exchange, "task.#")
    return queue


async def test_a_subscriber_queue_full_for_a_while_costs_no_duplicates_past_its_refusals(
    settings: Settings, store: Store, pool: asyncpg.Pool
) -> None:
    """sked.events is for anyone to subscribe to. A subscriber whose queue is bounded with
    `x-overflow: reject-publish` and full made RabbitMQ nack every relay publish routed to it.
    The relay treated the nack as a failure of the whole pass: it rolled back and published the
    same pass again, every message of it, on every retry, so every other subscriber got the
    whole pass again each time. Now the messages confirmed go for good, and nothing behind a
    refused one is sent: only the refused message is sent again (here the tasks' first events,
    v1); their later ones reach the healthy subscriber once, and once the full queue has room,
    it gets every event in order."""
    connection = await aio_pika.connect_robust(settings.rabbitmq_url)
    try:
        channel = await connection.channel()
        full = await bounded_queue(channel, "someone.elses.bounded.queue", {"x-max-length": 3})
        for _ in range(3):  # its consumer is late: the queue is full
            await channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=full.name)
        await make_events(store, 10, "nack")  # v1, v2, v3 of 10 tasks: three messages
        async with sink_on(settings.rabbitmq_url) as sink:
            bus = AmqpBus(settings.rabbitmq_url)
            await bus.connect()
            relay = Relay(
                settings.model_copy(update={"relay_batch": 1000, "relay_sweep_s": 0.5}), store, bus
            )
            runner = asyncio.create_task(relay.run())
            try:
                await asyncio.sleep(2.0)  # the relay tries, and tries again
                await full.purge()  # its consumer caught up: room for three messages
                await eventually(lambda: is_empty(pool), timeout=15, what="the outbox drained")
            finally:
                relay.stop()
                await cancel(runner)
                await bus.close()
            await eventually(
                lambda: asyncio.sleep(0, len(set(sink.arrivals)) == 30),
                timeout=10,
                what="the healthy subscriber received every event",
            )
        copies = Counter(sink.arrivals)
        again = sorted({v for (_, v), n in copies.items() if n > 1})
        assert again == [1], f"sent again to the healthy subscriber: versions {again}"
        got: dict[UUID, list[int]] = {}
        while (message := await full.get(no_ack=True, fail=False)) is not None:
            for e in EventMessage.model_validate_json(message.body).events:
                got.setdefault(e.task_id, []).append(e.version)
        assert len(got) == 10
        assert all(versions == [1, 2, 3] for versions in got.values()), got
    finally:
        await connection.close()


async def is_empty(pool: asyncpg.Pool) -> bool:
    return await unpublished(pool) == 0


async def test_a_queue_that_refuses_for_good_is_named_in_an_error_once_and_retried_calmly(
    settings: Settings,
    store: Store,
    pool: asyncpg.Pool,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A subscriber's reject-publish queue that stays full holds the stream back (each task's
    order, and each subscriber's every event, come first: the README tells subscribers not to
    bound a queue so). The relay used to say only a warning per retry naming a DeliveryError.
    Now, past REFUSALS_BEFORE_ERROR refusals of the same message in a row, it logs one error a
    minute naming the likely cause, and retries with a backoff, not on every NOTIFY."""
    monkeypatch.setattr(relay_module, "REFUSALS_BEFORE_ERROR", 3, raising=False)
    connection = await aio_pika.connect_robust(settings.rabbitmq_url)
    try:
        channel = await connection.channel()
        full = await bounded_queue(channel, "stuck.bounded.queue", {"x-max-length": 1})
        await channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=full.name)
        await make_events(store, 3, "stuck")
        bus = AmqpBus(settings.rabbitmq_url)
        await bus.connect()
        relay = Relay(settings.model_copy(update={"relay_linger_s": 0}), store, bus)

        def tries() -> int:
            return sum(
                r.levelno == logging.INFO and r.name == "shared.relay" for r in caplog.records
            )

        runner = asyncio.create_task(relay.run())
        try:
            with caplog.at_level(logging.INFO, logger="shared.relay"):

                async def said() -> list[logging.LogRecord]:
                    return [
                        r
                        for r in caplog.records
                        if r.levelno == logging.ERROR and r.name == "shared.relay"
                    ]

                await eventually(said, timeout=20, what="an error about the refusals")
                await eventually(lambda: asyncio.sleep(0, tries() >= 5), timeout=20)
                for i in range(3):  # transitions elsewhere NOTIFY the relay: no retry each time
                    await make_events(store, 1, f"busy{i}")
                    await asyncio.sleep(0.05)
                before = tries()
                await asyncio.sleep(0.5)
                assert tries() <= before + 1
        finally:
            relay.stop()
            await cancel(runner)
            await bus.close()
        errors = [
            r for r in caplog.records if r.levelno == logging.ERROR and r.name == "shared.relay"
        ]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        assert "reject-publish" in errors[0].getMessage()
        assert await unpublished(pool) > 0
    finally:
        await connection.close()


# --------------------------------------------------------------------------------------------
# 3. a refused message did not stop the messages after it: a task's events arrived out of order


async def test_a_refused_message_does_not_let_a_tasks_later_event_overtake_it(
    settings: Settings, store: Store, pool: asyncpg.Pool
) -> None:
    """The relay published all of a pass's messages at once and only then looked at the
    confirms. If RabbitMQ refused one (a subscriber's bounded queue, momentarily full), the
    messages after it — holding the same task's later events — were already queued: that
    subscriber got v3 before v2, and v2 only on the retry. By the documented rule ("a consumer
    keeps the highest version it applied per task and drops anything not above it") v2 was then
    dropped: the subscriber never applied the task's Pending event. Now a message goes out only
    once every earlier event of its tasks was confirmed (outbox_pack.waves)."""
    [task] = await store.tasks.create_many([spec("order")])
    task = await fsm.apply(store.tasks, task, State.PENDING, reason="p" * 900)
    task = await fsm.apply(store.tasks, task, State.READY)
    async with store.transaction() as tx:
        rows = await tx.outbox.unpublished(list(range(16)), 100)
    sizes = [len(_body(batch)) for _, batch in pack(rows)]
    assert len(sizes) == 3, sizes  # created (v1), pending (v2, long), ready (v3)
    s0, s1, s2 = sizes
    limit = s1 + 16  # v2 fits alone but not behind v1; v1 and v3 fit together
    assert s0 + s2 <= limit < s0 + s1, sizes

    connection = await aio_pika.connect_robust(settings.rabbitmq_url)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(
            "bounded.subscriber",
            arguments={"x-max-length-bytes": limit, "x-overflow": "reject-publish"},
        )
        await queue.bind(exchange, "task.#")
        bus = AmqpBus(settings.rabbitmq_url)
        await bus.connect()
        relay = Relay(settings.model_copy(update={"relay_sweep_s": 0.5}), store, bus)
        runner = asyncio.create_task(relay.run())
        arrivals: list[int] = []
        try:
            await asyncio.sleep(1.0)  # the subscriber is a second late to consume
            async with queue.iterator() as messages:

                async def take() -> None:
                    async for message in messages:
                        await message.ack()
                        body = EventMessage.model_validate_json(message.body)
                        arrivals.extend(e.version for e in body.events)

                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(take(), 10)
        finally:
            relay.stop()
            await cancel(runner)
            await bus.close()
        applied: list[int] = []
        for version in arrivals:  # the documented consumer rule
            if not applied or version > applied[-1]:
                applied.append(version)
        assert applied == [1, 2, 3], (
            f"the subscriber received versions {arrivals}: applying the highest version rule"
            f" it applied {applied}; outbox left: {await unpublished(pool)}"
        )
    finally:
        await connection.close()


# --------------------------------------------------------------------------------------------
# 4. one outbox row of a state this relay did not know stopped every relay


async def test_an_outbox_row_of_an_unknown_state_does_not_stop_the_relay(
    settings: Settings, store: Store, pool: asyncpg.Pool
) -> None:
    """The outbox's to_status is free text (no CHECK). A row naming a state this relay's
    version does not know — written by a newer scheduler during a rolling upgrade (the docs
    discuss relays and schedulers of different versions around migrations), or by hand —
    made `Outbox.unpublished` raise KeyError: not a transient error, so the relay service
    exited, and every relay (and every restart) failed on the same first page: no event of any
    task was relayed again until someone deleted the row. Now it is relayed under its own
    name (routing key task.<state>), with a warning."""
    await pool.execute(
        "INSERT INTO outbox (task_id, to_status, at, body)"
        " VALUES (gen_random_uuid(), 'some_newer_state', now(), '{}')"
    )
    await make_events(store, 3, "after-poison")
    connection = await aio_pika.connect_robust(settings.rabbitmq_url)
    channel = await connection.channel()
    exchange = await channel.declare_exchange(
        EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
    )
    newer = await channel.declare_queue(exclusive=True)
    await newer.bind(exchange, "task.some_newer_state")
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    relay = Relay(settings.model_copy(update={"relay_sweep_s": 0.5}), store, bus)
    runner = asyncio.create_task(relay.run())
    try:
        await asyncio.sleep(3.0)
        crashed = runner.exception() if runner.done() else None
        left = await unpublished(pool)
        said = f"relay exited with {crashed!r}; {left} outbox rows left (the good events too)"
        assert crashed is None, said
        assert left == 0, said
        assert await newer.get(no_ack=True, fail=False) is not None
    finally:
        relay.stop()
        await cancel(runner)
        await bus.close()
        await connection.close()


async def test_a_publish_to_a_frozen_broker_raises_in_bounded_time(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AmqpBus.publish — a scheduler's dispatches, a producer's submit, an alert — waited for
    its confirms with no bound: a frozen link or a resource alarm held the dispatch loop (and
    every task behind it) until AMQP heartbeats noticed, or for ever. It raises TimeoutError
    (transient: a dispatch takes its attempts back) after PUBLISH_TIMEOUT_S."""
    from shared import bus as bus_module

    monkeypatch.setattr(bus_module, "PUBLISH_TIMEOUT_S", 1.0)
    async with proxied(settings.rabbitmq_url) as (url, proxy):
        bus = AmqpBus(url)
        await bus.connect()
        proxy.freeze()
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(
                    bus.publish(EVENTS_EXCHANGE, [Outgoing("task.ready", b"{}")]), 10
                )
            assert asyncio.get_running_loop().time() - started < 5
        finally:
            proxy.thawed.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(bus.close(), 5)
