"""The scheduler's loops: intake, dispatch, retry sweep and queue reconciliation.

intake    submissions from `sked.submit`, in batches: Created -> Pending -> Ready in one
          transaction, then into the Redis ready queue, then one multiple-ack.
dispatch  pop by aged priority, place on nodes under their row locks, CAS Ready -> Scheduling
          with the node, send each attempt to its node's queue. Woken by intake, by capacity
          being freed (NOTIFY) and by nodes joining — never a tight poll.
retry     RetryWait tasks whose backoff elapsed -> Ready (SKIP LOCKED, shared by replicas),
          sleeping until the earliest `next_retry_at` or a NOTIFY of a new RetryWait.
reconcile rebuild the ready queue after a Redis loss; re-queue Ready tasks Redis lost track
          of (a scheduler killed between pop and CAS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from aio_pika.abc import AbstractIncomingMessage

from services.scheduler.intake import Accepted, Rejected, judge, read_json, same_spec, traceparent
from shared import fsm, hooks, workflows
from shared.bus import DISPATCH_EXCHANGE, SUBMIT_QUEUE, WORKFLOW_KEY, AmqpBus, Outgoing
from shared.dag import WorkflowSpec
from shared.errors import InvalidSpec, one_line
from shared.fsm import State
from shared.models import Dispatch, Task, TaskSpec, task_id_for_workflow
from shared.placement import Choice, Need, NodeState, place_many
from shared.policy import JobPolicy
from shared.queues import RESOURCE_KEY, ReadyQueue, rebuild, reconcile
from shared.resilience import TRANSIENT, supervise
from shared.runtime import next_batch, wait_any
from shared.settings import Settings
from shared.store import NODE_CHANNEL, TASK_CHANNEL, Store, Tx, parse_notify

log = logging.getLogger(__name__)

# A NOTIFY naming one of these states may have freed capacity on a node.
FREES_CAPACITY = {
    s.value
    for s in (
        State.SUCCESS,
        State.FAILED,
        State.TIMED_OUT,
        State.LOST,
        State.CANCELED,
        State.PAUSED,
        State.RETRY_WAIT,
        State.READY,
    )
}


# A NOTIFY naming one of these may decide workflow tasks downstream.
DECIDES_DOWNSTREAM = {
    s.value for s in (State.SUCCESS, State.FAILED, State.TIMED_OUT, State.CANCELED, State.SKIPPED)
}

# A task with no dependencies is ready as soon as it is accepted.
ADMISSION = (State.PENDING, State.READY)


def need_of(task: Task) -> Need:
    spec = task.spec
    return Need(
        cpu=spec.resources.cpu,
        memory_mb=spec.resources.memory_mb,
        gpu=spec.resources.gpu,
        selector=spec.selector,
    )


class Scheduler:
    """One replica; any number may run against the same Postgres, Redis and RabbitMQ."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        bus: AmqpBus,
        queue: ReadyQueue,
    ) -> None:
        self.settings = settings
        self.store = store
        self.bus = bus
        self.queue = queue
        self.policy = JobPolicy.of(settings.allowed_handlers, settings.allowed_commands)
        # None is the stop signal for the intake loop
        self._inbox: asyncio.Queue[AbstractIncomingMessage | None] = asyncio.Queue()
        self._wake_dispatch = asyncio.Event()
        self._new_work = asyncio.Event()  # set by intake: dispatch without lingering
        self._unpark = asyncio.Event()  # nodes changed: parked tasks go back in line
        # a task ended: tasks waiting for a named resource go back in line; `_ends` counts
        # those notifications, so a pass that parked after one arrived knows it missed it.
        # Only a scheduler that parked some does this on its dispatch path (a Redis round trip
        # per pass otherwise); the reconcile period covers a parker that died.
        self._unpark_resources = asyncio.Event()
        self._ends = 0
        self._parked_resource_waiters = False
        self._wake_resolve = asyncio.Event()
        self._finished: set[UUID] = set()  # tasks that finished (or were resumed) lately
        self._resolve_all = True
        self._wake_retry = asyncio.Event()
        self._stopping = asyncio.Event()
        self.ready = asyncio.Event()  # set once consuming: tests and `sked dev` wait on it

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        stop = self._stopping
        await supervise("rebuild the ready queue", self._rebuild_once, stop)
        listener = self.store.listener(
            [(TASK_CHANNEL, self._on_task_notify), (NODE_CHANNEL, self._on_node_notify)],
            on_reconnect=self._missed_notifications,
        )
        channel = await self.bus.consumer_channel(prefetch=self.settings.submit_batch * 2)
        submit = await channel.get_queue(SUBMIT_QUEUE)
        tag = await submit.consume(self._inbox.put)
        log.info("scheduler consuming %s", SUBMIT_QUEUE)
        self.ready.set()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(listener.run(stop))
                group.create_task(supervise("intake", self._intake_loop, stop))
                group.create_task(supervise("dispatch", self._dispatch_loop, stop))
                group.create_task(supervise("retry sweep", self._retry_loop, stop))
                group.create_task(supervise("reconcile", self._reconcile_loop, stop))
                group.create_task(supervise("workflows", self._resolve_loop, stop))
        finally:
            with contextlib.suppress(*TRANSIENT):
                await submit.cancel(tag)
                await channel.close()

    async def _rebuild_once(self) -> None:
        await self.rebuild_queue()

    def _missed_notifications(self) -> None:
        """After LISTEN came back: anything may have happened meanwhile — look at all of it."""
        self._unpark.set()
        self._unpark_resources.set()
        self._wake_retry.set()
        self._wake_dispatch.set()

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put_nowait(None)

    # -- intake -------------------------------------------------------------------------------

    async def _intake_loop(self) -> None:
        """Take submissions in batches: wait for the first, then whatever else has arrived."""
        while (batch := await next_batch(self._inbox, self.settings.submit_batch)) is not None:
            await self.accept(batch)

    async def accept(self, batch: Sequence[AbstractIncomingMessage]) -> list[Task]:
        """Admit a batch of submissions; returns the tasks it made Ready.

        No message can stop intake: whatever cannot be read, validated or stored is
        dead-lettered alone with its reason, and the rest of the batch is admitted. A statement
        that fails for a reason of one row is retried on halves of the batch until that row is
        found (`_admit_isolating`). Only a server being away (a transient error) hands the
        whole batch back to RabbitMQ, to be delivered again.
        """
        try:
            refused: list[tuple[AbstractIncomingMessage, str]] = []
            tasks: list[_Submission] = []
            seen: dict[UUID, _Submission] = {}
            for message in batch:
                if message.routing_key == WORKFLOW_KEY:
                    reason = await self._accept_workflow(message)
                    if reason is not None:
                        refused.append((message, reason))
                    continue
                verdict = judge(
                    message.body,
                    message.content_type,
                    message.message_id,
                    self.settings.max_message_bytes,
                    self.policy,
                )
                if isinstance(verdict, Rejected):
                    refused.append((message, verdict.reason))
                    continue
                first = seen.get(verdict.task_id)
                if first is not None:
                    # one task id twice in a batch (a duplicated message, a reused key)
                    if not same_spec(first.accepted.spec.model_dump_json(), verdict.spec):
                        refused.append((message, _conflict(verdict)))
                    continue
                seen[verdict.task_id] = submission = _Submission(message, verdict)
                tasks.append(submission)
            ready, failed = await self._admit_isolating(tasks)
            refused.extend(failed)
            for message, reason in refused:
                log.warning("dead-lettering a submission: %s", reason)
                await self.bus.dead_letter(
                    message.body,
                    reason,
                    message.routing_key or "",
                    {"x-sked-message-id": message.message_id or ""},
                )
        except TRANSIENT:
            # Postgres, Redis or RabbitMQ is away: hand the batch back to RabbitMQ to deliver
            # again (if the channel itself is gone, RabbitMQ requeues it anyway)
            with contextlib.suppress(*TRANSIENT):
                await batch[-1].nack(multiple=True, requeue=True)
            raise
        await batch[-1].ack(multiple=True)
        return ready

    async def _admit_isolating(
        self, subs: list[_Submission]
    ) -> tuple[list[Task], list[tuple[AbstractIncomingMessage, str]]]:
        """Admit `subs`; if a statement fails for anything but a transient error, admit the
        halves apart, down to the one submission that fails, which is refused with the error.
        Admission is idempotent (task ids), so retrying what was admitted changes nothing."""
        if not subs:
            return [], []
        try:
            return await self._admit_submissions(subs)
        except TRANSIENT:
            raise
        except Exception as exc:
            if len(subs) == 1:
                log.exception("submission %s cannot be admitted", subs[0].accepted.task_id)
                return [], [(subs[0].message, f"cannot be admitted: {one_line(exc)}")]
            half = len(subs) // 2
            ready, refused = await self._admit_isolating(subs[:half])
            more, worse = await self._admit_isolating(subs[half:])
            return ready + more, refused + worse

    async def _admit_submissions(
        self, subs: list[_Submission]
    ) -> tuple[list[Task], list[tuple[AbstractIncomingMessage, str]]]:
        task_ids = [s.accepted.task_id for s in subs]
        parents = [traceparent(s.message.headers) for s in subs]
        contexts, handles = hooks.received(SUBMIT_QUEUE, task_ids, parents)
        try:
            ready, existing = await self.admit([s.accepted.spec for s in subs], task_ids, contexts)
        finally:
            hooks.finished(handles)
        # a task id that named a task already: the same submission again is harmless; another
        # spec under the same idempotency key (or message id) is refused, not swallowed
        refused = [
            (s.message, _conflict(s.accepted, existing[s.accepted.task_id]))
            for s in subs
            if s.accepted.task_id in existing
            and not same_spec(existing[s.accepted.task_id].spec_json, s.accepted.spec)
        ]
        return ready, refused

    async def _accept_workflow(self, message: AbstractIncomingMessage) -> str | None:
        """A whole workflow: admitted, or the reason to dead-letter it whole (a cycle, an
        unknown edge, a key another task holds, ... or any error of its own)."""
        try:
            if len(message.body) > self.settings.max_message_bytes:
                raise InvalidSpec(f"message of {len(message.body)} bytes exceeds the limit")
            data = read_json(message.body)
            if isinstance(data, Rejected):
                return data.reason
            spec = WorkflowSpec.parse(data)
            for task in spec.tasks:
                refused = self.policy.refuses(task.spec().job)
                if refused:
                    raise InvalidSpec(f"task {task.name!r}: {refused}")
            workflow_id = task_id_for_workflow(message.message_id)
            ready = await workflows.admit(
                self.store, workflow_id, spec, traceparent(message.headers)
            )
        except TRANSIENT:
            raise
        except InvalidSpec as exc:
            return str(exc)
        except Exception as exc:
            log.exception("workflow message %s cannot be admitted", message.message_id)
            return f"cannot be admitted: {one_line(exc)}"
        await self.queue.push(ready)
        self._new_work.set()
        self._wake_dispatch.set()
        log.info("workflow %s (%s): %d tasks", workflow_id, spec.name, len(spec.tasks))
        return None

    async def admit(
        self,
        specs: Sequence[TaskSpec],
        ids: Sequence[UUID],
        traceparents: Sequence[str | None] | None = None,
    ) -> tuple[list[Task], dict[UUID, Task]]:
        """Create tasks and walk the new ones Created -> Pending -> Ready (one statement).
        Returns the new Ready tasks, and the tasks that existed already, by id.

        When nothing is queued ahead of them, they are placed in the same transaction and
        skip the Redis queue: no older or higher task waits, so the order is the same, and a
        submission reaches its node in one commit instead of three.
        """
        if not specs:
            return [], {}
        direct = not await self.queue.size()
        ends = self._ends
        async with self.store.transaction() as tx:
            admitted = await tx.tasks.admit_many(specs, ids, ADMISSION, traceparents)
            ready = [t for t, new in admitted if new and t.status is State.READY]
            existing = {t.id: t for t, new in admitted if not new}
            moved: list[Task] = []
            waiting = {t.id: Choice(None, fits_later=True) for t in ready}
            if direct and ready:
                moved, waiting = await self._place(tx, ready)
        await self._hand_over(moved, ready, waiting, ends)
        if waiting:
            self._new_work.set()
            self._wake_dispatch.set()
        return ready, existing

    # -- dispatch -----------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        while not self._stopping.is_set():
            self._wake_dispatch.clear()
            self._new_work.clear()
            if self._unpark.is_set():
                self._unpark.clear()
                await self.queue.unpark()
            if self._unpark_resources.is_set():
                self._unpark_resources.clear()
                if self._parked_resource_waiters:
                    self._parked_resource_waiters = False  # set again by any it re-parks
                    await self.queue.unpark(RESOURCE_KEY)
            while await self.dispatch_once() >= self.settings.dispatch_batch:
                pass  # a full batch went out: there may be more to place right away
            await wait_any(self._wake_dispatch, self._stopping, timeout=self.settings.reconcile_s)
            if not self._new_work.is_set():
                # woken by a freed slot: let a few more free up so one pass places them all;
                # new work cuts this short, so a submission never waits for it
                await wait_any(
                    self._new_work, self._stopping, timeout=self.settings.dispatch_linger_s
                )

    async def dispatch_once(self) -> int:
        """One pass: place as many queued tasks as nodes have room for. Returns how many.

        The nodes' rows stay locked from reading their usage to the CAS that reserves on them,
        so two schedulers placing at once serialise here and neither overcommits a node.
        """
        if not await self.queue.size():
            return 0  # most wake-ups (a task finished) find nothing queued: skip the locks
        ends = self._ends
        ids: list[UUID] = []
        try:
            async with self.store.transaction() as tx:
                nodes = [n.state() for n in await tx.nodes.lock_and_read()]
                free = sum(max(n.slots - n.used_slots, 0) for n in nodes if n.ready)
                if free <= 0:
                    return 0
                ids = await self.queue.pop(min(free, self.settings.dispatch_batch))
                if not ids:
                    return 0
                tasks, fenced = await tx.tasks.get_ready(ids)
                order = {task_id: i for i, task_id in enumerate(ids)}
                tasks.sort(key=lambda t: order[t.id])
                moved, waiting = await self._place(tx, tasks, nodes)
        except TRANSIENT:
            await self._put_back(ids)
            raise
        for task in fenced:
            # paused while its executor could not hear it: the old attempt may run until its
            # lease runs out, so this one waits in line (docs: at most one live attempt)
            waiting[task.id] = Choice(
                None, f"waiting for attempt {task.lease_attempt} to stop (its lease)", True
            )
        await self._hand_over(moved, tasks + fenced, waiting, ends)
        return len(moved)

    async def _put_back(self, ids: list[UUID]) -> None:
        """The pass failed after its pop (nothing it wrote committed): return the popped tasks
        to the queue now rather than leave them to the reconcile period. If Postgres is the
        one away, reconciliation re-adds them once it is back."""
        if not ids:
            return
        with contextlib.suppress(*TRANSIENT):
            free, fenced = await self.store.tasks.get_ready(ids)
            await self.queue.push(free + fenced)

    async def _place(
        self,
        tx: Tx,
        tasks: list[Task],
        nodes: list[NodeState] | None = None,
    ) -> tuple[list[Task], dict[UUID, Choice]]:
        """Inside a transaction: place `tasks` in order on the locked nodes and CAS the placed
        ones Ready -> Scheduling. Returns them, and {task id: why not} for the rest."""
        if nodes is None:
            nodes = [n.state() for n in await tx.nodes.lock_and_read()]
        tasks, blocked = await self._within_resources(tx, tasks)
        placed, unplaced = place_many([(t.id, need_of(t)) for t in tasks], nodes)
        unplaced.update(blocked)
        moves = [
            fsm.plan(t, State.SCHEDULING, "placed", node=placed[t.id])
            for t in tasks
            if t.id in placed
        ]
        moved = await tx.tasks.transition_many(moves)
        return moved, unplaced

    async def _within_resources(
        self, tx: Tx, tasks: list[Task]
    ) -> tuple[list[Task], dict[UUID, Choice]]:
        """Hold back the workflow tasks whose named resources are all taken: they wait in line
        (a holder's end frees a unit and wakes dispatch). Counted under the placement locks,
        so two passes never hand out the same unit."""
        users = [t for t in tasks if t.uses and t.workflow_id is not None]
        if not users:
            return tasks, {}
        held = await tx.workflows.resources_held(list({t.workflow_id for t in users}))  # type: ignore[misc]
        allowed: list[Task] = []
        blocked: dict[UUID, Choice] = {}
        for task in tasks:
            keys = [(task.workflow_id, r) for r in task.uses] if task.workflow_id else []
            full = [k for k in keys if k in held and held[k][0] >= held[k][1]]
            if full:
                name = full[0][1]
                taken, capacity = held[full[0]]
                blocked[task.id] = Choice(
                    None, f"waiting for resource {name} ({taken}/{capacity} held)", True, name
                )
                continue
            for k in keys:
                if k in held:
                    held[k] = (held[k][0] + 1, held[k][1])
            allowed.append(task)
        return allowed, blocked

    async def _hand_over(
        self, moved: list[Task], tasks: list[Task], waiting: dict[UUID, Choice], ends: int
    ) -> None:
        """After COMMIT: dispatch what was placed; queue the rest with the reason they wait —
        in line if a node could take them once it has room, parked if none can at all.

        Dispatches go out only after the commit: an executor whose CAS ran before it would not
        see the Scheduling row (its snapshot predates the commit) and would drop the attempt.
        """
        headers, handles = hooks.dispatching(moved) if hooks.installed else ([{}] * len(moved), [])
        messages = [_dispatch(t, h) for t, h in zip(moved, headers, strict=True)]
        try:
            await self.bus.publish(DISPATCH_EXCHANGE, messages)
        except TRANSIENT:
            await self._take_back(moved)
            raise
        finally:
            hooks.finished(handles)
        await self._queue_waiting(tasks, waiting, ends)

    async def _take_back(self, moved: list[Task]) -> None:
        """The dispatches may not have gone out (RabbitMQ away): put the attempts back in line
        rather than leave them to the stuck-in-Scheduling sweep. A dispatch that did arrive
        then loses its start CAS, so nothing runs twice."""
        with contextlib.suppress(*TRANSIENT):
            back = await self.store.tasks.transition_many(
                [fsm.plan(t, State.READY, "dispatch not confirmed") for t in moved]
            )
            await self.queue.push(back)

    async def _queue_waiting(
        self, tasks: list[Task], waiting: dict[UUID, Choice], ends: int
    ) -> None:
        """Tasks a node can take once it has room go back in line; those no node can take
        are parked until nodes change; those waiting for a named resource until a task ends.
        `ends` is the count of task-end notifications before the resources were counted: if
        one came since, a holder may have ended unseen, so the resource waiters go back now."""
        if not waiting:
            return
        kinds: dict[str, list[Task]] = {"line": [], "parked": [], "resource": []}
        for task in tasks:
            choice = waiting.get(task.id)
            if choice is not None:
                kind = "resource" if choice.resource else "line" if choice.fits_later else "parked"
                kinds[kind].append(task)
        await self.queue.push(kinds["line"])
        await self.queue.park(kinds["parked"])
        if kinds["resource"]:
            await self.queue.park(kinds["resource"], RESOURCE_KEY)
            self._parked_resource_waiters = True
            if self._ends != ends:
                self._unpark_resources.set()
        if kinds["parked"] or kinds["resource"]:
            # they left the queue: the tasks behind them get the slots they were popped for
            self._wake_dispatch.set()
            self._new_work.set()
        await self.store.tasks.set_wait_reasons(
            {k: c.reason for k, c in waiting.items() if c.reason}
        )

    # -- retries ------------------------------------------------------------------------------

    async def _retry_loop(self) -> None:
        while not self._stopping.is_set():
            self._wake_retry.clear()
            moved = await self.store.claims.sweep_due_retries(self.settings.dispatch_batch)
            if moved:
                await self.queue.push(moved)
                self._wake_dispatch.set()
                continue
            # how long until the next is due, by Postgres's clock: a local clock that is off
            # would shift every retry by its error
            due_in = await self.store.tasks.next_retry_due()
            wait = self.settings.reconcile_s
            if due_in is not None:
                wait = min(wait, max(due_in, 0.0))
            await wait_any(self._wake_retry, self._stopping, timeout=wait)

    # -- reconciliation -----------------------------------------------------------------------

    async def rebuild_queue(self) -> int:
        return await rebuild(self.queue, self.store.tasks)

    async def reconcile_once(self) -> int:
        n = await reconcile(self.queue, self.store.tasks, self.settings.reconcile_s)
        # the backstop for resource waiters, whichever scheduler parked them (one that died
        # before a holder ended, or a pass that raced with another)
        n += await self.queue.unpark(RESOURCE_KEY)
        if n:
            self._wake_dispatch.set()
        return n

    async def _reconcile_loop(self) -> None:
        while not self._stopping.is_set():
            jitter = random.uniform(0.8, 1.2)
            await wait_any(self._stopping, timeout=self.settings.reconcile_s * jitter)
            if not self._stopping.is_set():
                await self.reconcile_once()

    # -- workflows ----------------------------------------------------------------------------

    async def _resolve_loop(self) -> None:
        """Release or skip Pending workflow tasks when their upstreams finish: woken by the
        NOTIFY of a finish (or of a resume to Pending), with a sweep every reconcile period."""
        while not self._stopping.is_set():
            self._wake_resolve.clear()
            if self._resolve_all:
                self._resolve_all = False
                candidates = await self.store.workflows.pending_with_deps(10_000)
            else:
                named, self._finished = self._finished, set()
                candidates = [*await self.store.workflows.downstream_of(list(named)), *named]
            if candidates:
                ready, skipped = await workflows.resolve(self.store, candidates)
                if ready:
                    await self.queue.push(ready)
                    self._new_work.set()
                    self._wake_dispatch.set()
                if ready or skipped:
                    continue  # skips and releases may decide more downstream right away
            woke = await wait_any(
                self._wake_resolve, self._stopping, timeout=self.settings.reconcile_s
            )
            if not woke:
                self._resolve_all = True

    # -- notifications ------------------------------------------------------------------------

    def _on_task_notify(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        notice = parse_notify(payload)
        states = notice.states
        if states & DECIDES_DOWNSTREAM or State.PENDING.value in states:
            if notice.ids is None:
                self._resolve_all = True
            else:
                self._finished.update(notice.ids)
            self._wake_resolve.set()
        if states & FREES_CAPACITY:
            self._ends += 1
            self._unpark_resources.set()
            self._wake_dispatch.set()
        if State.RETRY_WAIT.value in states:
            self._wake_retry.set()

    def _on_node_notify(self, *_: object) -> None:
        # a node joined or changed: parked tasks may fit now
        self._unpark.set()
        self._wake_dispatch.set()


@dataclass(frozen=True)
class _Submission:
    message: AbstractIncomingMessage
    accepted: Accepted


def _conflict(accepted: Accepted, existing: Task | None = None) -> str:
    key = accepted.spec.idempotency_key
    named = f"idempotency key {key!r}" if key is not None else "its message id"
    where = f"task {existing.id}" if existing is not None else f"task {accepted.task_id}"
    return (
        f"{named} already names {where}, submitted with a different spec: a key (or message "
        f"id) stands for one task; use a new one for a different task"
    )


def _dispatch(task: Task, headers: dict[str, Any]) -> Outgoing:
    assert task.node is not None
    body = Dispatch(
        task_id=task.id,
        attempt=task.attempt,
        version=task.version,
        retry_count=task.retry_count,
        max_retries=task.max_retries,
        node=task.node,
    )
    return Outgoing(task.node, body.model_dump_json().encode(), headers)
