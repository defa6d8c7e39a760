"""Operator control of single tasks and of whole workflows (pause, resume, cancel) — through
the FSM like every change.

Each action re-reads the task and retries its CAS when the task moved meanwhile (a running
task may finish while an operator pauses it): the action applies to whatever state the task is
in by then, or fails with a clear error if that state is terminal. Stopping a running process
is the executor's part: it hears the NOTIFY of the move and stops the attempt.
"""

from __future__ import annotations

import getpass
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from uuid import UUID

from redis.exceptions import RedisError

from shared import fsm
from shared.errors import InvalidSpec, NotAllowed, StaleWrite, one_line
from shared.fsm import State
from shared.jsonvalue import note
from shared.models import MAX_PRIORITY, MIN_PRIORITY, Task
from shared.queues import ReadyQueue
from shared.store import Store
from shared.store.workflows import OpenTask

log = logging.getLogger(__name__)

ATTEMPTS = 20
WORKFLOW_BATCH = 1000  # moves a statement of a whole workflow's control makes


async def _tidy(what: str, queue_work: Awaitable[Any]) -> None:
    """The ready queue's part of a change already committed: best effort. Raising here told
    the operator (503) that a change had failed which had been made, and kept it out of the
    API's audit. Nothing is lost without it: a Ready task missing from the queue is queued
    again by the reconciler, and a stale entry is dropped at dispatch."""
    try:
        await queue_work
    except (RedisError, OSError) as exc:  # Redis away, or one it refused
        log.warning(
            "%s: the ready queue not updated (%s); the reconciler will", what, one_line(exc)
        )


def operator() -> str:
    """Who is acting, when the caller does not say: user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _refuse(action: str, task: Task) -> None:
    if fsm.is_terminal(task.status, fsm.has_retry_left(task)):
        raise NotAllowed(
            f"cannot {action} task {task.id}: it is {task.status.label}, a terminal state"
        )


async def pause(store: Store, task_id: UUID, reason: str, by: str | None = None) -> Task:
    """Any non-terminal state -> Paused. A running attempt is stopped by its executor; no
    retry is spent, and the task does not start again until resumed."""
    who, reason = note("by", by or operator()), note("reason", reason)
    for _ in range(ATTEMPTS):
        task = await store.tasks.get(task_id)
        _refuse("pause", task)
        if task.status is State.PAUSED:
            raise NotAllowed(f"task {task_id} is already paused (by {task.paused_by})")
        try:
            moved: Task = await fsm.apply(
                store.tasks,
                task,
                State.PAUSED,
                reason=f"paused by {who}: {reason}",
                paused_by=who,
                paused_reason=reason,  # paused_at: Postgres's now(), set by the move itself
            )
        except StaleWrite:
            continue
        return moved
    raise StaleWrite(f"task {task_id} kept changing; pause not applied")


async def cancel(
    store: Store,
    queue: ReadyQueue | None,
    task_id: UUID,
    reason: str = "",
    by: str | None = None,
) -> Task:
    """Any non-terminal state -> Canceled (terminal). A running attempt is stopped."""
    who, reason = note("by", by or operator()), note("reason", reason)
    for _ in range(ATTEMPTS):
        task = await store.tasks.get(task_id)
        _refuse("cancel", task)
        text = f"canceled by {who}" + (f": {reason}" if reason else "")
        try:
            moved: Task = await fsm.apply(store.tasks, task, State.CANCELED, reason=text)
        except StaleWrite:
            continue
        if queue is not None:  # tidy only: a popped Canceled task is dropped anyway
            # (in line, or parked: then nothing else would)
            await _tidy(f"task {task_id} canceled", queue.remove([task_id]))
        return moved
    raise StaleWrite(f"task {task_id} kept changing; cancel not applied")


async def cancel_workflow(
    store: Store,
    queue: ReadyQueue | None,
    workflow_id: UUID,
    reason: str = "",
    by: str | None = None,
) -> list[Task]:
    """Every task of the workflow that has not ended -> Canceled, WORKFLOW_BATCH a statement,
    all in one transaction that locks them first: running attempts are stopped by their
    executors, and Pending ones are never released (nor does anything move meanwhile).
    Returns the tasks canceled. Raises NotFound for an unknown workflow, NotAllowed when every
    task of it has ended already."""
    who, reason = note("by", by or operator()), note("reason", reason)
    text = f"canceled with workflow {workflow_id} by {who}" + (f": {reason}" if reason else "")
    return await _whole_workflow(
        store,
        queue,
        workflow_id,
        lambda t: True,
        lambda t: fsm.plan(t, State.CANCELED, text),
        "has ended: every task of it is terminal",
    )


async def pause_workflow(
    store: Store, queue: ReadyQueue | None, workflow_id: UUID, reason: str, by: str | None = None
) -> list[Task]:
    """Every task of the workflow that has not ended and is not paused -> Paused, as `pause`
    does one (who, why; running attempts stopped, no retry spent), WORKFLOW_BATCH a statement
    in one transaction (`_whole_workflow`). Pending tasks are paused too, so nothing is
    released until `resume_workflow`. Returns the tasks paused. Raises NotFound, or NotAllowed
    when there is nothing left to pause."""
    who, reason = note("by", by or operator()), note("reason", reason)
    text = f"paused with workflow {workflow_id} by {who}: {reason}"
    return await _whole_workflow(
        store,
        queue,
        workflow_id,
        lambda t: t.status is not State.PAUSED,
        lambda t: fsm.plan(t, State.PAUSED, text, paused_by=who, paused_reason=reason),
        "has nothing to pause: every task of it has ended or is paused",
    )


async def _whole_workflow(
    store: Store,
    queue: ReadyQueue | None,
    workflow_id: UUID,
    wanted: Callable[[OpenTask], bool],
    move: Callable[[OpenTask], fsm.Move],
    nothing: str,
) -> list[Task]:
    """`move` every task of the workflow that has not ended and is `wanted`, in statements of
    WORKFLOW_BATCH, in one transaction that first locks every one of them (id order, as the
    resolver locks): a resolver pass between two statements saw an upstream canceled and its
    `always` downstream still Pending, and released it. Returns the tasks moved; NotAllowed
    saying the workflow `nothing` when no task was to be moved at all."""
    async with store.transaction() as tx:
        live = [t for t in await tx.workflows.lock_open(workflow_id) if wanted(t)]
        if not live:
            raise NotAllowed(f"workflow {workflow_id} {nothing}")
        done: list[Task] = []
        for start in range(0, len(live), WORKFLOW_BATCH):
            some = live[start : start + WORKFLOW_BATCH]
            done += await tx.tasks.transition_many([move(t) for t in some])
    if queue is not None:  # tidy only: a popped task that is not Ready is dropped anyway
        await _tidy(f"workflow {workflow_id}", queue.remove([t.id for t in live]))
    return done


async def resume_workflow(
    store: Store, queue: ReadyQueue, workflow_id: UUID, by: str | None = None
) -> list[Task]:
    """Every paused task of the workflow: Paused -> Pending, and a task without upstreams on
    to Ready and into the queue (the others wait in Pending for the scheduler to judge their
    dependencies, as `resume` does one), WORKFLOW_BATCH a statement in one transaction that
    locks them first. Returns the tasks resumed (as they are now). Raises NotFound, or
    NotAllowed when no task of it is paused."""
    said = f"resumed with workflow {workflow_id}" + (f" by {note('by', by)}" if by else "")
    resumed: list[Task] = []
    ready: list[Task] = []
    async with store.transaction() as tx:
        paused = [t for t in await tx.workflows.lock_open(workflow_id) if t.status is State.PAUSED]
        if not paused:
            raise NotAllowed(
                f"workflow {workflow_id} has nothing to resume: no task of it is paused"
            )
        downstream = await tx.workflows.with_upstreams(workflow_id)
        for start in range(0, len(paused), WORKFLOW_BATCH):
            some = paused[start : start + WORKFLOW_BATCH]
            pending = await tx.tasks.transition_many(
                [fsm.plan(t, State.PENDING, said) for t in some]
            )
            roots = [t for t in pending if t.id not in downstream]
            now = await tx.tasks.transition_many(
                [fsm.plan(t, State.READY, f"{said}: no dependencies") for t in roots]
            )
            ready += now
            by_id = {t.id: t for t in now}
            resumed += [by_id.get(t.id, t) for t in pending]
    await _tidy(f"workflow {workflow_id} resumed", queue.push(ready))
    return resumed


async def resume(store: Store, queue: ReadyQueue, task_id: UUID, by: str | None = None) -> Task:
    """Paused -> Pending -> Ready, and into the ready queue. The next attempt gets a new
    attempt number; retry_count is unchanged (a pause costs no retry). `by`, when given, is
    named in the event (the operator API gives its token's name)."""
    said = "resumed" if by is None else f"resumed by {note('by', by)}"
    for _ in range(ATTEMPTS):
        task = await store.tasks.get(task_id)
        if task.status is not State.PAUSED:
            _refuse("resume", task)
            raise NotAllowed(f"task {task_id} is {task.status.label}, not paused")
        if await store.workflows.has_deps(task_id):
            # a workflow task: back to Pending; the scheduler re-evaluates its dependencies
            moved = await store.tasks.transition(fsm.plan(task, State.PENDING, said))
            if moved is None:
                continue
            return moved
        async with store.transaction() as tx:
            pending = await tx.tasks.transition_many([fsm.plan(task, State.PENDING, said)])
            if not pending:
                continue  # it moved meanwhile: look again
            # a task with no dependencies is ready at once
            ready = await tx.tasks.transition_many(
                [fsm.plan(pending[0], State.READY, f"{said}: no dependencies")]
            )
        await _tidy(f"task {task_id} resumed", queue.push(ready))
        return ready[0]
    raise StaleWrite(f"task {task_id} kept changing; resume not applied")


async def set_priority(
    store: Store, queue: ReadyQueue | None, task_id: UUID, priority: int
) -> list[Task]:
    """Change a non-terminal task's own priority. For a workflow task the effective priorities
    are recomputed (its upstreams inherit it, brief §7); the Ready tasks among those that moved
    are re-scored in the ready queue at once. Returns the tasks whose priority was written, the
    task itself first."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidSpec(f"a priority is an integer, not {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidSpec(f"priority must be within [{MIN_PRIORITY}, {MAX_PRIORITY}]: {priority}")
    task = await store.tasks.get(task_id)
    _refuse("reprioritise", task)
    changed = await store.tasks.reprioritise(task, priority)
    if queue is not None:
        # re-scored in place (ZADD); one popped meanwhile is gone from the queue already and
        # comes back, if at all, only as a stale entry that dispatch drops
        ready = [t for t in changed if t.status is State.READY]
        await _tidy(f"task {task_id} reprioritised", queue.push(ready))
    changed.sort(key=lambda t: t.id != task_id)
    return changed
