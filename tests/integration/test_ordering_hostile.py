"""The scheduler's ordering promises (docs/architecture.md, "The ready queue and aging"; brief
§4) where intake places submissions itself: priority first, FIFO within a priority, and
nothing placed ahead of a line Redis lost."""

from __future__ import annotations

import asyncio
from uuid import uuid4

from services.executor.node import items_of
from services.executor.service import Executor
from services.scheduler.service import Scheduler
from shared import fsm
from shared.dispatches import LINE_HEADER, entry_of, pack
from shared.fsm import State
from shared.settings import Settings
from shared.task import Task
from shared.wiring import backends
from tests.fakes import StubMessage
from tests.helpers import spec


async def test_intake_places_a_batch_by_priority_not_by_arrival(settings: Settings) -> None:
    """One intake batch (two submissions that arrived together, or one submit.batch message)
    holding a priority-0 task and then a priority-100 task, on an idle cluster with one free
    slot. Both become Ready in the same statement (same queued_at), so by the queue's score
    the priority-100 task goes first: it should get the slot and the priority-0 task wait in
    line. Intake's placement-ahead planned the batch in arrival order, so the priority-0 task
    took the slot. Now it plans in the line's order (ahead.NodeView.plan)."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await scheduler.reconciler.rebuild()  # as at its start: the line is known whole
        await b.bus.declare_node_queue(await b.bus.consumer_channel(1), "n1")
        await b.store.nodes.register("n1", 1, 0.0, 0, 0, {}, uuid4(), prefetch=0)
        low, high = uuid4(), uuid4()
        specs = [spec("low", priority=0), spec("high", priority=100)]
        await scheduler.intake.admit(specs, [low, high])
        got = {t.id: t.status for t in await b.store.tasks.get_many([low, high])}
        assert got == {high: State.SCHEDULING, low: State.READY}


async def test_intake_does_not_place_ahead_of_ready_tasks_redis_lost(settings: Settings) -> None:
    """A priority-100 task waits Ready (no room: its node's only slot is taken). Redis then
    loses its data (FLUSHDB: the queue and its built marker are gone; the docs say the queue
    is rebuilt from Postgres by the next reconcile). The slot frees, and a priority-0 task is
    submitted before that reconcile. Intake places a submission in its admission statement
    only when "nothing older or higher waits" (docs/architecture.md, step 2), so the new
    priority-0 task should wait in line and the slot go to the priority-100 task. Intake read
    only ZCARD of the (lost) queue, saw 0, and placed the newcomer ahead of the older, higher
    task, as every submission until the reconcile did. Now it reads the built marker in the
    same round trip (ReadyQueue.waiting), places nothing ahead of a lost line, and asks the
    reconciler to rebuild it at once (Hub.rebuild)."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await b.bus.declare_node_queue(await b.bus.consumer_channel(1), "n1")
        await b.store.nodes.register("n1", 1, 0.0, 0, 0, {}, uuid4(), prefetch=0)
        [busy] = await b.store.tasks.create_many([spec("busy")], walk=(State.PENDING, State.READY))
        [high] = await b.store.tasks.create_many(
            [spec("high", priority=100)], walk=(State.PENDING, State.READY)
        )
        await scheduler.reconciler.rebuild()
        assert await scheduler.queue.pop(1) == [high.id]  # ahead of busy, as it should be
        await scheduler.queue.push([high])
        busy = await fsm.apply(b.store.tasks, busy, State.SCHEDULING, node="n1")  # slot taken
        await scheduler.queue.remove([busy.id])
        assert await scheduler.dispatch.dispatch_once() == 0  # no room: high waits in line
        await b.ready_queue.redis.flushdb()  # Redis loses its data
        await fsm.apply(b.store.tasks, busy, State.READY, reason="dispatch lost")  # slot freed
        low_id = uuid4()
        await scheduler.intake.admit([spec("low", priority=0)], [low_id])
        got = {t.id: t.status for t in await b.store.tasks.get_many([low_id, high.id])}
        assert got[low_id] is State.READY, f"the priority-0 newcomer jumped the line: {got}"
        assert scheduler.hub.rebuild.is_set()


async def test_submissions_admitted_together_keep_their_fifo_order(settings: Settings) -> None:
    """Five priority-0 submissions arrive in one intake batch (separate producers' messages
    taken together, or one submit_many), while no node has room, so they go in line. Equal
    priorities should leave the line in the order they were submitted (FIFO, brief §4 and
    docs/architecture.md) — the order intake's own placement-ahead uses for them when there
    is room. The admission statement stamped them all with one now(), so their scores tied
    and Redis broke the tie by member: they left in task-id order. Now each is stamped now()
    plus its position in microseconds."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await b.store.nodes.register("n1", 1, 0.0, 0, 0, {}, uuid4(), prefetch=0)
        [busy] = await b.store.tasks.create_many([spec("busy")], walk=(State.PENDING, State.READY))
        await fsm.apply(b.store.tasks, busy, State.SCHEDULING, node="n1")  # its slot is taken
        ids = sorted((uuid4() for _ in range(5)), reverse=True)  # submitted in this order
        await scheduler.intake.admit([spec(f"t{i}") for i in range(5)], ids)
        assert await scheduler.queue.pop(5) == ids


async def _scheduled_on_n1(executor: Executor, name: str, priority: int = 0) -> Task:
    store = executor.store.tasks
    task = await store.create(spec(name, priority=priority))
    for target in (State.PENDING, State.READY):
        task = await fsm.apply(store, task, target)
    return await fsm.apply(store, task, State.SCHEDULING, node="n1")


def _dispatched(executor: Executor, task: Task) -> StubMessage:
    """Its dispatch message as a dispatch pass sends it: with its score in the line."""
    line = {LINE_HEADER: repr(executor.node.queue.score_of(task))}
    return StubMessage(pack([(entry_of(task), line)]), "n1")


async def test_a_freed_slot_goes_to_the_higher_priority_held_dispatch(executor: Executor) -> None:
    """A node (2 slots) whose slots are both taken holds two dispatches in its backlog: a
    priority-0 task's, received first, then a priority-100 task's (Ready in the same second:
    by the line's score it is far ahead). When one slot frees, the higher-priority attempt
    should be claimed into it. The backlog was a plain FIFO of arrival (the dispatch did not
    carry the priority), so the priority-0 task took the slot: a priority inversion inside
    the node. Now a dispatch pass sends each task's score in the line (LINE_HEADER), and a
    freed slot takes the held dispatch first in line (backlog.next_in_line)."""
    busy = [await _scheduled_on_n1(executor, f"busy{i}") for i in range(2)]
    assert await executor.starter.start([_dispatched(executor, t) for t in busy]) == 2  # type: ignore[list-item]
    await asyncio.wait(executor.node.runs, timeout=30)
    ended = executor.node.outcomes.get_nowait()
    assert ended is not None
    low = await _scheduled_on_n1(executor, "low", priority=0)
    high = await _scheduled_on_n1(executor, "high", priority=100)
    for task in (low, high):
        executor.starter.held.extend(items_of(_dispatched(executor, task)))  # type: ignore[arg-type]
    await executor.finisher.finish([ended])  # one slot freed: one held dispatch claimed
    got = {t.id: t.status for t in await executor.store.tasks.get_many([low.id, high.id])}
    if executor.node.runs:
        await asyncio.wait(executor.node.runs, timeout=30)
    assert got == {high.id: State.RUNNING, low.id: State.SCHEDULING}
