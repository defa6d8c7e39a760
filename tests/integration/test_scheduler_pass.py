"""One dispatch pass of an in-process scheduler on real Postgres, Redis and RabbitMQ: a pass
that fails after popping puts what it popped back in line at once."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

import asyncpg
import pytest

from services.scheduler.service import Scheduler
from shared import fsm
from shared.dispatches import unpack
from shared.fsm import State
from shared.settings import Settings
from shared.store.notify import TASK_CHANNEL
from shared.wiring import backends
from tests.helpers import spec


async def test_a_failed_pass_puts_the_popped_tasks_back(settings: Settings) -> None:
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await b.store.nodes.register("n1", 4, 2.0, 1024, 0, {}, uuid4())
        ready = await b.store.tasks.create_many(
            [spec(f"t{i}") for i in range(3)], walk=(State.PENDING, State.READY)
        )
        await scheduler.queue.push(ready)

        async def deadlocked(*_: Any) -> Any:
            # what Postgres does to one side of a lock cycle, after the pop
            raise asyncpg.exceptions.DeadlockDetectedError("deadlock detected")

        scheduler.dispatch.place = deadlocked  # type: ignore[method-assign]
        with pytest.raises(asyncpg.exceptions.DeadlockDetectedError):
            await scheduler.dispatch.dispatch_once()
        assert await scheduler.queue.size() == 3  # back in line, not lost until reconcile
        assert await scheduler.queue.absent([t.id for t in ready]) == []
        assert {t.status for t in await b.store.tasks.list_tasks()} == {
            State.READY
        }  # none committed


async def test_a_pass_fills_a_full_nodes_backlog(settings: Settings) -> None:
    """A node whose slots are all taken still has room for its backlog (SKED_PREFETCH): a pass
    places up to slots + prefetch there, no more. (The pass once counted only the slots as
    room, so a backlog never filled once the slots had: every freed slot waited for a round
    through the scheduler again.)"""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await b.bus.declare_node_queue(await b.bus.consumer_channel(1), "n1")
        await b.store.nodes.register("n1", 2, 0.0, 0, 0, {}, uuid4(), prefetch=3)
        ready = await b.store.tasks.create_many(
            [spec(f"t{i}") for i in range(7)], walk=(State.PENDING, State.READY)
        )
        await scheduler.queue.push(ready)
        assert await scheduler.dispatch.dispatch_once() == 5
        assert await scheduler.dispatch.dispatch_once() == 0  # slots and backlog full
        statuses = [t.status for t in await b.store.tasks.list_tasks()]
        assert statuses.count(State.SCHEDULING) == 5
        assert statuses.count(State.READY) == 2


async def test_a_pass_dispatches_what_the_store_holds(settings: Settings) -> None:
    """A placement's rows are not read back whole (fsm.Move.read_back): the dispatch it sends
    still carries each attempt, version and node as the store holds them after the move —
    what the executor's claim CAS is made against."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        queue = await b.bus.declare_node_queue(await b.bus.consumer_channel(4), "n1")
        await b.store.nodes.register("n1", 4, 0.0, 0, 0, {}, uuid4(), prefetch=0)
        ready = await b.store.tasks.create_many(
            [spec(f"t{i}") for i in range(3)], walk=(State.PENDING, State.READY)
        )
        await scheduler.queue.push(ready)
        assert await scheduler.dispatch.dispatch_once() == 3
        message = await queue.get(timeout=5)
        sent = {
            e.dispatch.task_id: (e.dispatch.attempt, e.dispatch.version, e.dispatch.node)
            for e in unpack(message.body)
            if e.dispatch is not None
        }
        stored = await b.store.tasks.get_many([t.id for t in ready])
        assert sent == {t.id: (t.attempt, t.version, t.node) for t in stored}
        assert {(t.status, t.attempt, t.node) for t in stored} == {(State.SCHEDULING, 1, "n1")}


async def test_a_dispatch_no_queue_takes_goes_back_to_ready_at_once(settings: Settings) -> None:
    """A node's row but no queue bound for it (its executor registered and has not declared
    it yet, or it expired): RabbitMQ returns the dispatch. The attempt is back in Ready and in
    line, not left in Scheduling for the stuck sweep, and the node is passed over for a while
    (UNROUTABLE_S): the next pass does not place there again."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await b.store.nodes.register("n1", 2, 0.0, 0, 0, {}, uuid4())
        [task] = await b.store.tasks.create_many([spec("t")], walk=(State.PENDING, State.READY))
        await scheduler.queue.push([task])
        assert await scheduler.dispatch.dispatch_once() == 1  # placed, and came back
        back = await b.store.tasks.get(task.id)
        assert (back.status, back.status_reason) == (State.READY, "dispatch not confirmed")
        assert await scheduler.queue.absent([task.id]) == []  # in line again
        assert "n1" in scheduler.hub.unroutable
        assert await scheduler.dispatch.dispatch_once() == 0  # n1 passed over


async def test_a_pass_places_a_task_on_the_node_its_affinity_prefers(settings: Settings) -> None:
    """Affinity is a preference, not a filter (brief §4's score): of two equal nodes a task
    goes to the one carrying its preferred labels, and to the other when that one is full."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        channel = await b.bus.consumer_channel(1)
        for node, disk in (("a-hdd", "hdd"), ("b-ssd", "ssd")):
            await b.bus.declare_node_queue(channel, node)
            await b.store.nodes.register(node, 1, 0.0, 0, 0, {"disk": disk}, uuid4(), prefetch=0)
        for name in ("first", "second"):
            ready = await b.store.tasks.create_many(
                [spec(name, affinity={"disk": "ssd"})], walk=(State.PENDING, State.READY)
            )
            await scheduler.queue.push(ready)
            assert await scheduler.dispatch.dispatch_once() == 1
        placed = {t.name: t.node for t in await b.store.tasks.list_tasks()}
        # by id alone "a-hdd" would win the tie; "b-ssd" is full for the second
        assert placed == {"first": "b-ssd", "second": "a-hdd"}


async def test_a_task_placed_again_goes_to_another_node(settings: Settings) -> None:
    """A dispatch handed back (or a retry) is placed on another node than its last when one
    fits: the lower id, which wins ties, is where it was."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        channel = await b.bus.consumer_channel(1)
        for node in ("a", "b"):
            await b.bus.declare_node_queue(channel, node)
            await b.store.nodes.register(node, 1, 0.0, 0, 0, {}, uuid4(), prefetch=0)
        ready = await b.store.tasks.create_many([spec("t")], walk=(State.PENDING, State.READY))
        await scheduler.queue.push(ready)
        assert await scheduler.dispatch.dispatch_once() == 1
        (placed,) = await b.store.tasks.list_tasks()
        assert placed.node == "a"
        back = await fsm.apply(b.store.tasks, placed, State.READY, reason="handed back")
        await scheduler.queue.push([back])
        assert await scheduler.dispatch.dispatch_once() == 1
        (again,) = await b.store.tasks.list_tasks()
        assert (again.status, again.node) == (State.SCHEDULING, "b")


async def test_an_admission_placed_at_once_asks_its_scheduler_for_no_pass(
    settings: Settings,
) -> None:
    """The notifications a real admission sends (its tasks Ready, then Scheduling on their
    node), heard by the scheduler that admitted them, wake no dispatch pass: intake placed
    them itself. (At low rates that pass was a Redis round trip per submission.)"""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await scheduler.reconciler.rebuild()  # as at its start: the line is known whole
        await b.bus.declare_node_queue(await b.bus.consumer_channel(1), "n1")
        await b.store.nodes.register("n1", 4, 0.0, 0, 0, {}, uuid4())
        heard: asyncio.Queue[str] = asyncio.Queue()
        listener = await asyncpg.connect(settings.database_url)
        try:
            await listener.add_listener(TASK_CHANNEL, lambda *a: heard.put_nowait(a[3]))
            ready, _ = await scheduler.intake.admit([spec("t1"), spec("t2")], [uuid4(), uuid4()])
            payloads = [await asyncio.wait_for(heard.get(), 10) for _ in range(2)]
        finally:
            await listener.close()
        assert {t.status for t in await b.store.tasks.list_tasks()} == {State.SCHEDULING}
        hub = scheduler.hub
        hub.dispatch.clear()
        for payload in payloads:
            hub.task_notify(None, 0, TASK_CHANNEL, payload)
        assert not hub.dispatch.is_set(), payloads
        assert hub.admitted == {}
        # the same notifications heard by another scheduler do wake it: it cannot know
        other = Scheduler(settings, b.store, b.bus, b.ready_queue).hub
        other.task_notify(None, 0, TASK_CHANNEL, payloads[0])
        assert other.dispatch.is_set()
        assert len(ready) == 2
