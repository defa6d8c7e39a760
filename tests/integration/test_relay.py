"""The outbox relay against real Postgres and RabbitMQ, in-process and as killed processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit
from uuid import UUID

import aio_pika
import aiormq.exceptions
import asyncpg
import pytest

from services.relay.service import Relay
from shared import fsm
from shared.bus import DISPATCH_EXCHANGE, EVENTS_EXCHANGE, AmqpBus, Outgoing
from shared.fsm import State
from shared.models import EventMessage, Task
from shared.relay import OutboxRelay
from shared.settings import Settings
from shared.store import Store
from shared.store.queries import Q
from tests.conftest import RUN
from tests.helpers import ServiceProcess, eventually, spec

LIFE = [State.PENDING, State.READY, State.SCHEDULING, State.RUNNING, State.SUCCESS]


class EventSink:
    """A queue bound to sked.events with task.#, collecting (task_id, version) in arrival order."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[UUID, int]] = []
        self.routing: list[tuple[str, str]] = []

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
                        for e in body.events:
                            self.arrivals.append((e.task_id, e.version))
                            self.routing.append((message.routing_key or "", e.to_status.value))


@pytest.fixture
async def sink(settings: Settings) -> AsyncIterator[EventSink]:
    s = EventSink()
    ready = asyncio.Event()
    task = asyncio.create_task(s.consume(settings.rabbitmq_url, ready))
    await asyncio.wait_for(ready.wait(), 30)
    yield s
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def drive(store: Store, tasks: list[Task], steps: list[State], seed: int) -> None:
    """Move every task through `steps`, interleaving tasks, batch sizes and 4 concurrent movers."""
    rnd = random.Random(seed)
    current = {t.id: t for t in tasks}
    queue = [t.id for t in tasks for _ in steps]
    rnd.shuffle(queue)
    lock = asyncio.Lock()

    async def mover() -> None:
        while True:
            async with lock:
                if not queue:
                    return
                chunk = []
                while queue and len(chunk) < rnd.randint(1, 20):
                    tid = queue.pop()
                    if tid in chunk:
                        queue.insert(0, tid)
                        break
                    chunk.append(tid)
                moves = []
                for tid in chunk:
                    task = current[tid]
                    nxt = steps[LIFE.index(task.status) + 1] if task.status in LIFE else steps[0]
                    moves.append(fsm.plan(task, nxt))
                moved = await store.tasks.transition_many(moves)
                assert len(moved) == len(moves)
                for t in moved:
                    current[t.id] = t

    await asyncio.gather(*(mover() for _ in range(4)))


def check_order(arrivals: list[tuple[UUID, int]], expected: dict[UUID, int]) -> None:
    """Every version 1..N of every task arrived; dropping duplicates leaves them in order."""
    seen: dict[UUID, list[int]] = defaultdict(list)
    for task_id, version in arrivals:
        applied = seen[task_id]
        if applied and version <= applied[-1]:
            continue  # a duplicate after a crash: consumers drop it by (task_id, version)
        applied.append(version)
    assert set(seen) == set(expected)
    for task_id, top in expected.items():
        assert seen[task_id] == list(range(1, top + 1)), task_id


async def unpublished(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM outbox")


@contextlib.asynccontextmanager
async def running_relay(settings: Settings, store: Store, **update: Any) -> AsyncIterator[Relay]:
    """A relay running in this process on settings with `update`, stopped on the way out."""
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    relay = Relay(settings.model_copy(update=update), store, bus)
    runner = asyncio.create_task(relay.run())
    try:
        yield relay
    finally:
        relay.stop()
        await asyncio.wait_for(runner, 10)
        await bus.close()


async def test_thousand_transitions_arrive_in_order(
    settings: Settings, store: Store, pool: asyncpg.Pool, sink: EventSink
) -> None:
    async with running_relay(settings, store, relay_batch=100):
        tasks = await store.tasks.create_many([spec(f"r{i}") for i in range(200)])
        await drive(store, tasks, LIFE, seed=1)
        expected = {t.id: 6 for t in tasks}  # Created + 5 moves
        await eventually(lambda: _count(sink, 1200), timeout=60, what="1,200 events")
        assert len(sink.arrivals) == 1200  # no crash, so no duplicate
        check_order(sink.arrivals, expected)
        assert all(rk == f"task.{state}" for rk, state in sink.routing)

        async def drained() -> bool:
            # a subscriber may hold the last events before the relay's COMMIT deletes them
            return await unpublished(pool) == 0

        await eventually(drained, timeout=10, what="the outbox emptied by the relay")


async def test_a_start_alone_wakes_the_relay(
    settings: Settings, store: Store, sink: EventSink
) -> None:
    """An executor's claims (moves into Running only) are told on sked_started, not sked_task:
    the relay listens on both, so a lone start's event goes out at once rather than at the
    next sweep (an hour here)."""
    async with running_relay(settings, store, relay_sweep_s=3600.0):
        [task] = await store.tasks.create_many([spec("lone")])
        for target in LIFE[:3]:
            task = await fsm.apply(store.tasks, task, target, node="n1")
        await eventually(lambda: _count(sink, 4), timeout=10, what="the events up to Scheduling")
        await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(task.id))
        await eventually(lambda: _count(sink, 5), timeout=10, what="the start's event")
        assert sink.routing[-1] == ("task.running", "running")


async def test_a_busy_relay_stops_listening_and_listens_again_when_idle(
    settings: Settings, store: Store, sink: EventSink
) -> None:
    """While its passes find events the relay polls a linger apart and does not listen (every
    notifying commit would wake it and its backend); once a pass finds none it listens again,
    so an event after a quiet spell goes out at once, not at the next sweep (an hour here)."""
    async with running_relay(settings, store, relay_sweep_s=3600.0) as relay:
        await asyncio.wait_for(relay.ready.wait(), 10)
        listener = relay.listener
        assert listener is not None
        wanted: list[bool] = []
        pause, resume = listener.pause, listener.resume

        async def paused(timeout: float = 5.0) -> None:
            wanted.append(False)
            await pause(timeout)

        async def resumed(timeout: float = 5.0) -> None:
            wanted.append(True)
            await resume(timeout)

        listener.pause, listener.resume = paused, resumed  # type: ignore[method-assign]
        tasks = await store.tasks.create_many([spec(f"busy{i}") for i in range(20)])
        await drive(store, tasks, LIFE, seed=2)
        await eventually(lambda: _count(sink, 120), timeout=30, what="the busy spell's events")
        # The sink can hold every event while the pass that sent them still deletes their rows
        # and commits, before the relay gets to pausing: wait for the pause, then the resume.
        await eventually(lambda: _paused(wanted), timeout=10, what="it to stop listening")
        await eventually(lambda: _listening(listener), timeout=10, what="listening again")
        assert wanted[-1] is True  # the last word was to listen again
        [lone] = await store.tasks.create_many([spec("after")])
        await fsm.apply(store.tasks, lone, State.PENDING)
        await eventually(lambda: _count(sink, 122), timeout=10, what="the lone events")


async def _paused(wanted: list[bool]) -> bool:
    return False in wanted


async def _listening(listener: Any) -> bool:
    return bool(listener.wanted)


async def _count(sink: EventSink, n: int) -> bool:
    return len(sink.arrivals) >= n


async def test_killed_relay_loses_nothing(
    settings: Settings,
    service_env: dict[str, str],
    store: Store,
    pool: asyncpg.Pool,
    sink: EventSink,
    tmp_path: Path,
) -> None:
    env = {**service_env, "SKED_RELAY_BATCH": "20"}
    first = ServiceProcess("relay", env, tmp_path)
    second = None
    try:
        await first.wait_for_log("relay listening")
        tasks = await store.tasks.create_many([spec(f"k{i}") for i in range(200)])
        mover = asyncio.create_task(drive(store, tasks, LIFE, seed=2))

        async def midway() -> bool:
            return len(sink.arrivals) > 100

        await eventually(midway, timeout=60, what="the first relay to publish some events")
        first.kill()
        await mover
        assert await unpublished(pool) > 0, "the relay finished before it could be killed"
        second = ServiceProcess("relay", env, tmp_path)
        await eventually(
            lambda: _none_unpublished(pool), timeout=60, what="the second relay to drain"
        )
        await eventually(lambda: _count(sink, 1200), timeout=30, what="every event")
        check_order(sink.arrivals, {t.id: 6 for t in tasks})
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0, second.log()


async def _none_unpublished(pool: asyncpg.Pool) -> bool:
    return await unpublished(pool) == 0


def test_event_message_schema_is_json() -> None:
    body = EventMessage(events=[])
    assert json.loads(body.model_dump_json()) == {"schema_version": 1, "events": []}


async def test_events_nobody_subscribed_to_are_not_sent_back(settings: Settings) -> None:
    """Events go to whoever listens; with no subscriber RabbitMQ drops them. A mandatory
    publish would have it return each one whole to the relay. A dispatch to a node with no
    queue, published after the event on the same channel, is returned (dispatches are
    mandatory, and its publish raises): by then the event's return would have come."""
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    returned: list[str] = []
    bus.channel.return_callbacks.add(lambda _c, m: returned.append(m.routing_key or ""))
    try:
        await bus.publish(EVENTS_EXCHANGE, [Outgoing("nobody.listens", b"{}")])
        with pytest.raises(aiormq.exceptions.PublishError):
            await bus.publish(DISPATCH_EXCHANGE, [Outgoing("no-such-node", b"{}")])
        assert returned == ["no-such-node"]
    finally:
        await bus.close()


async def read_buffers(pool: asyncpg.Pool) -> int:
    """The buffers the relay's read of every shard touches along the primary key (EXPLAIN
    BUFFERS; an emptied table's statistics could have the planner scan its heap instead)."""
    sql = Q.unpublished.sql  # the relay's own read
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off")
        await conn.fetch(sql, list(range(16)), 1000)  # marks the dead entries it meets
        [(plan,)] = await conn.fetch(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", list(range(16)), 1000
        )
    top = json.loads(plan)[0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


async def test_the_relay_vacuums_the_rows_it_deleted(
    settings: Settings, store: Store, pool: asyncpg.Pool
) -> None:
    """A relay's read walks the key entries of every outbox row deleted before the last
    vacuum; with `vacuum_rows` the relay vacuums after deleting that many, so what a read
    walks stays bounded however many events went before (autovacuum is off on the
    development server: without this, it grew with every event ever published)."""
    rows = 12_000
    # this test's own database: autovacuum, where the server runs it, must not vacuum first
    await pool.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")

    async def fill() -> None:
        await pool.execute(
            "INSERT INTO outbox (task_id, to_status, at, body)"
            " SELECT gen_random_uuid(), 'success', now(), '{}' FROM generate_series(1, $1)",
            rows,
        )

    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    try:
        await fill()
        unvacuumed = OutboxRelay(store, bus, 1000, vacuum_rows=0)
        assert await unvacuumed.drain() == rows
        walked = await read_buffers(pool)
        await fill()
        relay = OutboxRelay(store, bus, 1000, vacuum_rows=5_000, vacuum_min_s=0)
        assert await relay.drain() == rows
    finally:
        await bus.close()
    assert (unvacuumed.vacuums, relay.vacuums) == (0, 2)
    # 12,000 dead entries are ~33 pages of the key; after the relay's vacuums, what its
    # last 2,000 deletes left
    assert walked >= 25
    assert await read_buffers(pool) <= walked // 3


async def test_a_relay_that_may_not_vacuum_says_so_once_and_relays_on(
    settings: Settings, dsn: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """Services may run as a role apart from the one that migrated (and owns the tables):
    Postgres would skip its VACUUM with a warning only in the server's log. The relay asks
    first, says once that it cannot, stops trying, and relays every event as before."""
    role = f"{RUN}_relay"
    await pool.execute(f"CREATE ROLE \"{role}\" LOGIN PASSWORD 'relay'")
    try:
        await pool.execute(f'GRANT SELECT, UPDATE, DELETE ON outbox, outbox_shards TO "{role}"')
        await pool.execute(
            "INSERT INTO outbox (task_id, to_status, at, body)"
            " SELECT gen_random_uuid(), 'success', now(), '{}' FROM generate_series(1, 3000)"
        )
        parts = urlsplit(dsn)
        as_role = urlunsplit(parts._replace(netloc=f"{role}:relay@{parts.netloc.split('@')[-1]}"))
        store = await Store.connect(as_role, 2)
        bus = AmqpBus(settings.rabbitmq_url)
        await bus.connect()
        try:
            relay = OutboxRelay(store, bus, 500, vacuum_rows=1_000, vacuum_min_s=0)
            with caplog.at_level(logging.WARNING, logger="shared.relay"):
                assert await relay.drain() == 3000
        finally:
            await bus.close()
            await store.close()
        said = [r for r in caplog.records if "cannot vacuum" in r.getMessage()]
        assert (len(said), relay.vacuums, relay.vacuum_rows) == (1, 0, 0)
        assert await pool.fetchval("SELECT count(*) FROM outbox") == 0
    finally:
        await pool.execute(f'DROP OWNED BY "{role}"')
        await pool.execute(f'DROP ROLE "{role}"')
