"""The schedule-to-start timeout on fakes: the spec field, when the clock starts (and what does
not restart it), the scheduler's sweep, and what is left in the ready queue. The same against
Postgres: tests/integration/test_schedule_timeout.py; end to end: tests/e2e/."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.cli import build_parser
from services.cli.commands import spec_from_args
from services.scheduler.dispatch import Dispatcher
from services.scheduler.hub import Hub
from services.scheduler.timeouts import ScheduleTimeouts
from shared import fsm
from shared.errors import InvalidSpec
from shared.fsm import State
from shared.models import Task, TaskSpec
from shared.outcome import not_started
from shared.queues import PARKED_KEY
from shared.settings import Settings
from tests.fakes import FakeReadyQueue, InMemoryStore, StubBus, new_task

SETTINGS = Settings(heartbeat_secret="unit-test-secret-0123456789", reconcile_s=5.0)
JOB = {"kind": "command", "argv": ["true"]}


def spec(name: str = "t", **kw: Any) -> TaskSpec:
    return TaskSpec.parse({"name": name, "job": JOB, **kw})


def parts(store: InMemoryStore) -> tuple[ScheduleTimeouts, Dispatcher, FakeReadyQueue, Hub]:
    queue, hub = FakeReadyQueue(), Hub()
    sweep = ScheduleTimeouts(SETTINGS, store, queue, hub)  # type: ignore[arg-type]
    dispatcher = Dispatcher(SETTINGS, store, StubBus(), queue, hub)  # type: ignore[arg-type]
    return sweep, dispatcher, queue, hub


async def ready(store: InMemoryStore, s: TaskSpec) -> Task:
    return await store.walk(store.put(new_task(s)), State.PENDING, State.READY)


def overdue(store: InMemoryStore, task: Task, by_s: float = 1.0) -> Task:
    """The task with its deadline `by_s` in the past (a clock we need not wait for)."""
    past = datetime.now(UTC) - timedelta(seconds=by_s)
    return store.put(replace(task, schedule_deadline=past))


# -- the spec ---------------------------------------------------------------------------------


def test_the_field_is_optional_positive_and_bounded_like_the_run_timeout() -> None:
    assert spec().schedule_timeout_s is None
    assert spec(schedule_timeout_s=2).schedule_timeout_s == 2.0
    assert spec(schedule_timeout_s=0.5).schedule_timeout_s == 0.5
    for bad in (0, -1, 7 * 86_400 + 1, "soon"):
        with pytest.raises(InvalidSpec, match="schedule_timeout_s"):
            spec(schedule_timeout_s=bad)
    described = TaskSpec.model_fields["schedule_timeout_s"].description or ""
    assert "entered Ready" in described
    assert "does not restart" in described


def test_the_cli_flag_sets_it() -> None:
    args = build_parser().parse_args(["submit", "--command", "true", "--schedule-timeout", "2"])
    assert spec_from_args(args).schedule_timeout_s == 2.0
    args = build_parser().parse_args(["submit", "--command", "true"])
    assert spec_from_args(args).schedule_timeout_s is None


def test_the_failure_names_the_timeout_and_is_final() -> None:
    task = replace(new_task(spec(schedule_timeout_s=2, max_retries=3)), status=State.READY)
    move = not_started(task)
    assert (move.source, move.target) == (State.READY, State.FAILED)
    assert move.reason == "not started within 2 s (schedule_timeout_s)"
    assert move.patch == {"error": move.reason, "retry_count": 3}


# -- the clock --------------------------------------------------------------------------------


async def test_the_clock_starts_on_entering_ready_and_a_bounce_keeps_it() -> None:
    store = InMemoryStore()
    plain = await ready(store, spec("plain"))
    assert plain.schedule_deadline is None  # no timeout, no deadline
    task = await ready(store, spec(schedule_timeout_s=30, max_retries=1))
    assert task.schedule_deadline is not None
    assert task.queued_at is not None
    assert task.schedule_deadline - task.queued_at == timedelta(seconds=30)
    first = task.schedule_deadline
    # placed, then back to Ready (a dispatch that failed): queued anew, same deadline
    task = await store.walk(task, State.SCHEDULING, State.READY, node="a")
    assert task.schedule_deadline == first
    # started and failed: after the backoff it enters Ready afresh, with a new deadline
    task = await store.walk(task, State.SCHEDULING, node="a")
    task = await store.walk(task, State.RUNNING, lease_owner=None)
    task = await store.walk(task, State.FAILED, State.RETRY_WAIT, retry_in_s=0)
    await asyncio.sleep(0.01)
    task = await store.walk(task, State.READY)
    assert task.schedule_deadline is not None
    assert task.schedule_deadline > first


# -- the sweep --------------------------------------------------------------------------------


async def test_overdue_tasks_in_ready_and_scheduling_fail_and_leave_the_queue() -> None:
    store = InMemoryStore()
    sweep, _dispatcher, queue, _ = parts(store)
    waiting = overdue(store, await ready(store, spec("waiting", schedule_timeout_s=2)))
    parked = overdue(store, await ready(store, spec("parked", schedule_timeout_s=2)))
    placed = await store.walk(
        await ready(store, spec("placed", schedule_timeout_s=2, max_retries=2)),
        State.SCHEDULING,
        node="a",
    )
    placed = overdue(store, placed)
    not_due = await ready(store, spec("not-due", schedule_timeout_s=60))
    without = await ready(store, spec("without"))  # no timeout: no deadline
    await queue.push([waiting, not_due, without])
    await queue.park([parked])

    assert (await store.tasks.next_schedule_deadline() or 0) < 0
    failed = await sweep.fail_overdue()
    assert {t.id for t in failed} == {waiting.id, parked.id, placed.id}
    for t in failed:
        assert (t.status, t.retry_count, t.max_retries) == (
            State.FAILED,
            t.max_retries,
            t.max_retries,
        )
        assert t.error == t.status_reason == "not started within 2 s (schedule_timeout_s)"
        assert fsm.is_terminal(t.status, fsm.has_retry_left(t))
    assert queue.parked(PARKED_KEY) == set()
    assert set(await queue.pop(10)) == {not_due.id, without.id}
    # what is left waits: the next deadline is the not-due task's, about a minute away
    left = await store.tasks.next_schedule_deadline()
    assert left is not None
    assert 50 < left <= 60
    assert await sweep.fail_overdue() == []


async def test_a_leftover_queue_entry_of_a_failed_task_is_dropped_by_dispatch() -> None:
    store = InMemoryStore()
    store.nodes.add("a")
    sweep, dispatcher, queue, _ = parts(store)
    task = overdue(store, await ready(store, spec(schedule_timeout_s=1)))
    await sweep.fail_overdue()
    await queue.push([task])  # as if a reconcile or a bounce had queued it again
    assert await dispatcher.dispatch_once() == 0
    assert (await store.tasks.get(task.id)).status is State.FAILED
    assert await queue.size() == 0


async def test_a_started_attempt_is_not_failed() -> None:
    store = InMemoryStore()
    sweep, *_ = parts(store)
    task = await ready(store, spec(schedule_timeout_s=1))
    task = await store.walk(task, State.SCHEDULING, node="a")
    task = overdue(store, await store.walk(task, State.RUNNING, lease_owner=None))
    assert await store.tasks.next_schedule_deadline() is None
    assert await sweep.fail_overdue() == []
    assert (await store.tasks.get(task.id)).status is State.RUNNING


async def test_a_ready_notification_of_a_task_with_a_deadline_wakes_the_loop() -> None:
    hub = Hub()
    one = "00000000-0000-0000-0000-000000000001"
    hub.task_notify(None, 0, "", f"{one}:3:ready")  # no deadline: it cannot be the earliest
    assert not hub.deadlines.is_set()
    hub.task_notify(None, 0, "", f"{one}:3:d:ready")
    assert hub.deadlines.is_set()
    hub.deadlines.clear()
    hub.task_notify(None, 0, "", f"{one}:3:d:w:ready")  # a workflow's task
    assert hub.deadlines.is_set()
    hub.deadlines.clear()
    hub.task_notify(None, 0, "", "*:500:ready")  # not listed: any may have one
    assert hub.deadlines.is_set()
    hub.deadlines.clear()
    hub.task_notify(None, 0, "", "*:500:running,success")
    assert not hub.deadlines.is_set()
    hub.missed()
    assert hub.deadlines.is_set()


async def test_the_loop_fails_a_task_when_its_deadline_comes() -> None:
    store = InMemoryStore()
    sweep, _, queue, hub = parts(store)
    stopping = asyncio.Event()
    loop = asyncio.create_task(sweep.run(stopping))
    try:
        await asyncio.sleep(0.05)  # the loop sleeps: nothing has a deadline
        task = await ready(store, spec(schedule_timeout_s=0.3))
        await queue.push([task])
        hub.deadlines.set()  # the NOTIFY of its move into Ready
        for _ in range(100):
            if (await store.tasks.get(task.id)).status is State.FAILED:
                break
            await asyncio.sleep(0.02)
        ended = await store.tasks.get(task.id)
        assert ended.status is State.FAILED, ended
        assert ended.updated_at - (task.queued_at or ended.updated_at) >= timedelta(seconds=0.3)
        assert await queue.size() == 0
    finally:
        stopping.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(loop, 5)
