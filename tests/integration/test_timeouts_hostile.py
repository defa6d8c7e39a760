"""The schedule timeout and placement planned ahead (intake's fast path) against races and
hostile specs, on real Postgres and Redis. Each case was found by an adversarial review, where
it failed: the docstrings say what happened; each test shows it no longer does."""

from __future__ import annotations

import asyncio
import json
from uuid import uuid4

import pytest
from redis.asyncio import Redis

from services.scheduler.dispatch import Dispatcher
from services.scheduler.hub import Hub
from services.scheduler.intake import Intake
from shared import fsm
from shared.fsm import State
from shared.intake import Rejected, judge
from shared.models import Task
from shared.outcome import not_started
from shared.queues import ReadyQueue
from shared.settings import Settings
from shared.store import Store
from tests.fakes import StubBus
from tests.helpers import spec

ADMISSION = (State.PENDING, State.READY)


async def ready(store: Store, name: str = "t", **kw: object) -> Task:
    (task, _), *_ = await store.tasks.admit_many([spec(name, **kw)], [uuid4()], ADMISSION)
    return task


async def test_a_launch_failure_after_a_timely_start_is_failed_as_never_started(
    store: Store,
) -> None:
    """The clock "stops when an attempt starts (Scheduling -> Running)" (docs/architecture.md,
    "The schedule timeout"); a launch failure (Running -> Ready, e.g. a warden that did not
    answer within SPAWN_ANSWER_S, an executor stopping, a pod unschedulable) is meant to go
    back in line without spending a retry, at most max_launch_failures times. But the move
    kept the absolute deadline (from a slot state), so the time spent Running counted: an
    attempt that started well within its schedule timeout and whose launch failure was
    reported after the deadline could no longer be placed (the CAS refuses Ready ->
    Scheduling) and the sweep at once failed it, final, "not started within 1 s" — a task
    whose start was on time, failed for good by a platform fault, its launch-failure budget
    unspent. Now a launch failure gets back the time it had left when it started."""
    task = await ready(store, schedule_timeout_s=1, max_launch_failures=3)
    task = await fsm.apply(store.tasks, task, State.SCHEDULING, node="n1")
    task = await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(uuid4()))
    assert task.started_at is not None  # started in time: the clock stopped here
    await asyncio.sleep(1.3)  # the launch is found to have failed later (the start budget)
    task = await fsm.apply(
        store.tasks, task, State.READY, reason="spawn not answered: never started"
    )
    assert task.launch_failures == 1
    failed = await store.claims.fail_unstarted(10, not_started)
    assert failed == [], (
        f"a task that started in time was failed as never started: {failed[0].status_reason}"
    )
    again = await fsm.apply(store.tasks, task, State.SCHEDULING, node="n2")
    assert again.status is State.SCHEDULING


async def test_a_launch_failure_of_a_task_without_a_schedule_timeout_keeps_none(
    store: Store,
) -> None:
    """The time handed back is the deadline less the start; a task with no deadline must
    keep none (Postgres's greatest() passes over a NULL: the first cut of the fix above gave
    every launch failure a deadline of now, and the sweep failed it at once)."""
    task = await ready(store, max_launch_failures=3)
    task = await fsm.apply(store.tasks, task, State.SCHEDULING, node="n1")
    task = await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(uuid4()))
    task = await fsm.apply(store.tasks, task, State.READY, reason="never started")
    assert task.schedule_deadline is None
    assert await store.claims.fail_unstarted(10, not_started) == []


async def test_a_new_low_priority_task_takes_the_slot_a_parked_higher_one_waited_for(
    store: Store, settings: Settings, redis_url: str
) -> None:
    """Intake places a submission in its creating statement "when nothing waits in line: no
    older or higher task waits, so the order is the same" (Intake.admit). But it looks only at
    the ready zset's size: a task *parked* (no node could take it when it was judged: its only
    matching node cordoned, not ready, or not yet registered) is not counted. When that node
    comes (uncordoned, back, joined; NOTIFY sked_node), the next submission re-reads the nodes
    and places itself on the node before the dispatch loop has unparked the older,
    higher-priority task that waited for exactly that node: the newcomer takes the last slot,
    the task that waited longest kept waiting (and with a schedule timeout, might fail for
    it). Now intake places nothing ahead while tasks asked back in line (a node changed) may
    not be there yet (Hub.returns_pending)."""
    redis = Redis.from_url(redis_url)
    try:
        queue, bus, hub = ReadyQueue(redis, aging_s=10.0), StubBus(), Hub()
        await queue.mark_built()  # as a scheduler's start leaves it
        dispatcher = Dispatcher(settings, store, bus, queue, hub)  # type: ignore[arg-type]
        intake = Intake(settings, store, bus, queue, hub, dispatcher)  # type: ignore[arg-type]
        gpu = {"pool": "gpu"}
        [urgent], _ = await intake.admit([spec("urgent", priority=10, selector=gpu)], [uuid4()])
        assert urgent.status is State.READY
        assert (await queue.depths())["parked"] == 1  # no node for it yet: parked
        await store.nodes.register("g", 1, 0.0, 0, 0, gpu, uuid4())
        hub.node_notify()  # the node's NOTIFY reaches this scheduler
        [late], _ = await intake.admit([spec("late", priority=0)], [uuid4()])
        after = await store.tasks.get(urgent.id)
    finally:
        await redis.aclose()
    assert late.status is State.READY or after.status is State.SCHEDULING, (
        f"the newer, lower-priority task took node g's only slot ({late.status.value} on "
        f"{late.node}) while the older priority-10 task that needed g stays "
        f"{after.status.value}, parked"
    )


@pytest.mark.parametrize("value", [True, "2"])
def test_a_schedule_timeout_that_is_no_json_number_is_refused(value: object) -> None:
    """`"schedule_timeout_s": true` was admitted as a 1 s schedule timeout (and `"2"` as 2 s):
    pydantic's lax mode turns a JSON boolean (or a string) into a float. A producer's mistake
    (a flag where a number belongs) silently became a task that fails, final, one second after
    it becomes Ready. Now every number of a spec is a JSON number or refused, naming the field
    (models.json_number)."""
    body = {"name": "x", "job": {"kind": "command", "argv": ["true"]}, "schedule_timeout_s": value}
    verdict = judge(json.dumps(body).encode(), "application/json", "m1", 1 << 20)
    assert isinstance(verdict, Rejected), (
        f"{value!r} accepted as schedule_timeout_s = "
        f"{getattr(getattr(verdict, 'spec', None), 'schedule_timeout_s', None)}"
    )
