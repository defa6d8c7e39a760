"""The Redis ready queue and the scheduler's use of it against a hostile or damaged Redis, on
real Postgres, Redis and RabbitMQ. Redis is a cache Postgres can rebuild: whatever it holds,
the scheduler must neither crash, stall, lose a task nor start one twice. Each case was found
by an adversarial review; its docstring says what the code did then, and the test shows it no
longer does (shared/queues.py: `_repairing`, `pop_scored`, `prune_parked`, `score`)."""

from __future__ import annotations

import asyncio
from uuid import uuid4

import pytest

from services.scheduler.service import Scheduler
from shared import control
from shared.fsm import State
from shared.queues import PARKED_KEY, READY_KEY, RESOURCE_KEY
from shared.settings import Settings
from shared.wiring import backends
from tests.helpers import spec

BOUND_S = 20.0  # every wait here is bounded: a hang is a failure, never a stuck run


async def _ready(b, n: int, name: str = "t"):  # type: ignore[no-untyped-def]
    return await b.store.tasks.create_many(
        [spec(f"{name}{i}") for i in range(n)], walk=(State.PENDING, State.READY)
    )


async def _node(b, node: str = "n1", slots: int = 4) -> None:  # type: ignore[no-untyped-def]
    await b.bus.declare_node_queue(await b.bus.consumer_channel(1), node)
    await b.store.nodes.register(node, slots, 0.0, 0, 0, {}, uuid4(), prefetch=0)


# -- tampered members ------------------------------------------------------------------------


async def test_a_non_uuid_member_neither_crashes_the_pass_nor_loses_the_tasks_popped_with_it(
    settings: Settings,
) -> None:
    """One member that is not a UUID (any Redis client can ZADD one; a huge one alike) sits at
    the head of `sked:ready`. The pass ZPOPMINs it together with the real tasks behind it and
    parses every member with UUID(): ValueError, not transient, so the dispatch loop — and
    with it the whole scheduler (its TaskGroup) — dies, and the real tasks it popped are gone
    from Redis, waiting for the reconcile period after a restart."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await _node(b)
        ready = await _ready(b, 3)
        await scheduler.queue.push(ready)
        await b.redis.zadd(READY_KEY, {"not-a-uuid" + "x" * 100_000: -1e12})
        error = None
        try:
            placed = await asyncio.wait_for(scheduler.dispatch.dispatch_once(), BOUND_S)
        except Exception as exc:
            error, placed = exc, 0
        lost = await scheduler.queue.absent([t.id for t in ready])
        statuses = {t.status for t in await b.store.tasks.get_many([t.id for t in ready])}
        assert (error, placed) == (None, 3), (
            f"pass raised {type(error).__name__}: {str(error)[:80]!r}; placed {placed}; "
            f"{len(lost)} of 3 real tasks now in no Redis set while {statuses}"
        )


async def test_a_ready_key_of_the_wrong_type_is_rebuilt_not_a_crash_loop(
    settings: Settings,
) -> None:
    """`sked:ready` holding a string (a stray SET by another client of the same Redis, a typo
    in an operator's command). Redis is only a cache of Postgres, so the scheduler should
    throw it away and rebuild; instead its start-up rebuild ZADDs into it and gets WRONGTYPE,
    a ResponseError that is not transient: the scheduler fails to start, and so does every
    replica, every restart — no task is ever placed again."""
    async with backends(settings) as b:
        await _node(b)
        ready = await _ready(b, 2)
        await b.redis.set(READY_KEY, "oops")
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        error = None
        try:
            async with asyncio.timeout(BOUND_S):
                async with scheduler:
                    while True:
                        rows = await b.store.tasks.get_many([t.id for t in ready])
                        if all(t.status is not State.READY for t in rows):
                            break
                        await asyncio.sleep(0.1)
        except Exception as exc:
            error = exc
        assert error is None, f"scheduler: {type(error).__name__}: {error}"


@pytest.mark.parametrize("key", [READY_KEY, PARKED_KEY, RESOURCE_KEY])
async def test_a_queue_key_retyped_while_running_is_repaired_by_reconcile(
    settings: Settings, key: str
) -> None:
    """The same while a scheduler runs, for any of the three sorted sets: the marker
    `sked:ready:built` is still there, so reconcile does not rebuild; it asks ZMSCORE of the
    wrong-typed key (or runs the unpark script on it) and raises WRONGTYPE (not transient:
    the scheduler stops). The key is never repaired."""
    settings = settings.model_copy(update={"reconcile_s": 0.05})
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await scheduler.reconciler.rebuild()  # as at start: the marker is written
        await b.redis.hset(key, "field", "value")
        await _ready(b, 1)
        await asyncio.sleep(0.2)  # older than the reconcile period: reconcile looks for it
        error = None
        try:
            await asyncio.wait_for(scheduler.reconciler.reconcile_once(), BOUND_S)
            await asyncio.wait_for(scheduler.reconciler.reconcile_once(), BOUND_S)
        except Exception as exc:
            error = exc
        kind = await b.redis.type(key)
        if kind == b"none":
            kind = b"zset"  # dropped: as good as an empty set
        assert (error, kind) == (None, b"zset"), f"{type(error).__name__}: {error}; key {kind!r}"


async def test_two_spellings_of_one_task_id_place_it_once(settings: Settings) -> None:
    """A member naming a task in another spelling (upper case: UUID() reads both alike) next
    to its own entry. The pass pops both; one comes back as the copy intake kept, the other
    is read from Postgres, and the same task goes into the placement twice."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await b.redis.zadd(READY_KEY, {str(uuid4()): 0.0})  # something waits: intake queues
        ready, _ = await scheduler.intake.admit([spec("t")], [uuid4()])
        await b.redis.zrem(
            READY_KEY,
            *[m for m in await b.redis.zrange(READY_KEY, 0, -1) if m.decode() != str(ready[0].id)],
        )
        assert len(scheduler.hub.queued) == 1  # kept, as intake queued it
        [task] = ready
        score = await b.redis.zscore(READY_KEY, str(task.id))
        await b.redis.zadd(READY_KEY, {str(task.id).upper(): score + 1})
        await _node(b)
        error = None
        try:
            placed = await asyncio.wait_for(scheduler.dispatch.dispatch_once(), BOUND_S)
        except Exception as exc:
            error, placed = exc, -1
        row = await b.store.tasks.get(task.id)
        assert (error, placed) == (None, 1), (
            f"{type(error).__name__}: {error}; placed {placed}; task {row.status} v{row.version}"
        )


# -- entries of tasks that are no longer Ready ------------------------------------------------


async def test_paused_tasks_at_the_head_of_the_line_do_not_idle_the_slots(
    settings: Settings,
) -> None:
    """Tasks paused while queued keep their members in `sked:ready` (control.pause, unlike
    cancel, never removes them). Each pass pops as many members as there are free slots,
    finds those tasks not Ready, drops them, places nothing — and the dispatch loop, having
    placed fewer than a batch, sleeps until a notification or SKED_RECONCILE_S (5 s). On a
    quiet system a Ready task behind k such members waits about k / free slots x 5 s while
    the slots stand idle: 40 paused tasks ahead and 2 free slots are ~100 s."""
    async with backends(settings) as b:
        await _node(b, slots=2)
        ahead = await _ready(b, 40, "paused")
        await b.ready_queue.push(ahead)
        for t in ahead:
            await control.pause(b.store, t.id, "hold", by="ops")
        [real] = await _ready(b, 1, "real")
        await b.ready_queue.push([real])
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        async with asyncio.timeout(BOUND_S):
            async with scheduler:
                for _ in range(60):  # 6 s: more than a reconcile period
                    if (await b.store.tasks.get(real.id)).status is not State.READY:
                        break
                    await asyncio.sleep(0.1)
                status = (await b.store.tasks.get(real.id)).status
                left = await b.ready_queue.size()
        assert status is State.SCHEDULING, (
            f"after 6 s with 2 idle slots the Ready task is still {status}; "
            f"{left - 1} members of paused tasks still ahead of it in sked:ready"
        )


async def test_aging_zero_gives_strict_priority_as_documented(settings: Settings) -> None:
    """docs/architecture.md: "an operator who wants strict priority sets W = 0"
    (SKED_AGING_S=0). But score = (t_ready - EPOCH) - priority * W: with W = 0 the priority
    term vanishes and the queue is pure FIFO — priority is ignored altogether, the opposite
    of what the operator asked for. A priority-100 task waits behind every priority-0 task
    queued a moment before it."""
    settings = settings.model_copy(update={"aging_s": 0.0})
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await _node(b, slots=1)
        low = await b.store.tasks.create_many(
            [spec("low", priority=0)], walk=(State.PENDING, State.READY)
        )
        await asyncio.sleep(0.05)
        high = await b.store.tasks.create_many(
            [spec("high", priority=100)], walk=(State.PENDING, State.READY)
        )
        await scheduler.queue.push(low + high)
        assert await asyncio.wait_for(scheduler.dispatch.dispatch_once(), BOUND_S) == 1
        placed = [t.name for t in await b.store.tasks.list_tasks() if t.status is State.SCHEDULING]
        assert placed == ["high"], f"with SKED_AGING_S=0 the slot went to {placed}"


async def test_a_parked_task_that_ends_leaves_no_member_behind(settings: Settings) -> None:
    """A task no node can take is parked in `sked:parked`. Paused there and then canceled
    (cancel tidies the sets only for a task that is Ready at that moment; pause never does),
    its member stays in `sked:parked` for good: reconcile only ever adds, a rebuild does not
    clear the parked sets, and only a node joining or changing moves them. Every such
    pause-then-cancel leaks a member into Redis for as long as the nodes stay unchanged."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await _node(b, slots=4)
        ready = await b.store.tasks.create_many(
            [spec(f"big{i}", resources={"gpu": 8}) for i in range(3)],
            walk=(State.PENDING, State.READY),
        )
        await scheduler.queue.push(ready)
        await asyncio.wait_for(scheduler.dispatch.dispatch_once(), BOUND_S)
        assert await b.redis.zcard(PARKED_KEY) == 3  # no node has a gpu: parked
        for t in ready:
            await control.pause(b.store, t.id, "hold", by="ops")
            await control.cancel(b.store, b.ready_queue, t.id, "no longer wanted", by="ops")
        await scheduler.reconciler.rebuild()
        await scheduler.reconciler.reconcile_once()
        statuses = {t.status for t in await b.store.tasks.get_many([t.id for t in ready])}
        leaked = await b.redis.zcard(PARKED_KEY)
        assert leaked == 0, f"{leaked} members of {statuses} tasks still in {PARKED_KEY}"
