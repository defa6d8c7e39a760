"""Intake: submissions from `sked.submit`, in batches. Each message is judged (shared.intake) —
a `submit.batch` message task by task; the valid tasks are created and walked Created ->
Pending -> Ready in one statement — and placed in the same transaction when nothing waits ahead
of them — the rest dead-lettered alone with their reason; then one multiple-ack. No message
can stop intake."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from uuid import UUID

import redis.exceptions
from aio_pika.abc import AbstractIncomingMessage

from services.scheduler.ahead import NodeView
from services.scheduler.dispatch import Dispatcher
from services.scheduler.follow import Follower
from services.scheduler.hub import Hub, Part
from shared import fsm, hooks, workflows
from shared.bus import BATCH_KEY, SUBMIT_KEY, SUBMIT_QUEUE, WORKFLOW_KEY, AmqpBus
from shared.dag import WorkflowSpec
from shared.errors import InvalidSpec, one_line
from shared.fsm import State
from shared.intake import (
    Accepted,
    Entry,
    Rejected,
    judge,
    judge_batch,
    read_json,
    same_spec,
    traceparent,
)
from shared.models import Task, TaskSpec, task_id_for_workflow
from shared.placement import Choice, Need
from shared.policy import JobPolicy
from shared.queues import ReadyQueue
from shared.resilience import TRANSIENT, isolate
from shared.runtime import both, next_batch
from shared.settings import Settings
from shared.store import Placing, Store

log = logging.getLogger(__name__)
# Redis not answering, as its client says it (socket and connect timeouts: queues.connect)
REDIS_AWAY = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

# A task with no dependencies is ready as soon as it is accepted.
ADMISSION = (State.PENDING, State.READY)


@dataclass(frozen=True)
class Refusal:
    """What is dead-lettered, and why: a whole message, or one task of a batch message."""

    body: bytes
    routing_key: str
    message_id: str
    reason: str

    @classmethod
    def of(cls, message: AbstractIncomingMessage, reason: str) -> Refusal:
        return cls(message.body, message.routing_key or "", message.message_id or "", reason)


Admitted = tuple[list[Task], list[Refusal]]  # the tasks made ready, the submissions refused


@dataclass(frozen=True)
class _Submission:
    accepted: Accepted
    entry: Entry  # as submitted: what a refusal dead-letters
    routing_key: str

    def refused(self, reason: str) -> Refusal:
        return _refusal(self.entry, self.routing_key, reason)


def _refusal(entry: Entry, routing_key: str, reason: str) -> Refusal:
    return Refusal(entry.body, routing_key, entry.message_id, reason)


# Admissions whose dispatches may await their confirms at once. RabbitMQ confirms a
# persistent message once it is on disk (or acknowledged), and its fsync here now and then
# takes 100-200 ms: at 100 tasks/s a bound of 8 stopped intake for the rest of such a wait
# (a p99 of 100-200 ms). The bound is backpressure for a broker that stops confirming.
MAX_SENDING = 256


class Intake(Part):
    def __init__(
        self,
        settings: Settings,
        store: Store,
        bus: AmqpBus,
        queue: ReadyQueue,
        hub: Hub,
        dispatcher: Dispatcher,
    ) -> None:
        super().__init__(settings, store, queue, hub)
        self.bus = bus
        self.dispatcher = dispatcher
        self.policy = JobPolicy.of(settings.allowed_handlers, settings.allowed_commands)
        # None is the stop signal
        self.inbox: asyncio.Queue[AbstractIncomingMessage | None] = asyncio.Queue()
        self._sending: set[asyncio.Task[None]] = set()  # dispatches awaiting their confirms
        self._view: NodeView | None = None  # the nodes placement ahead plans on
        # the dispatch messages of placements their nodes were told of by the commit
        self.follower = Follower(store, settings.dispatch_follow_s, dispatcher.send)

    async def run(self) -> None:
        """Take submissions in batches: wait for the first, then whatever else has arrived."""
        try:
            while (batch := await next_batch(self.inbox, self.settings.submit_batch)) is not None:
                if self.hub.redis_away.is_set():  # to another scheduler, not through a timeout
                    with contextlib.suppress(*TRANSIENT):
                        await batch[-1].nack(multiple=True, requeue=True)
                    continue
                await self.accept(batch)
            # stopping: the placements the follower holds are dispatched now if unclaimed, the
            # last admissions' included (its own loop may have ended before them)
            with contextlib.suppress(*TRANSIENT):
                await self.follower.send_due(None)
        finally:
            if self._sending:  # the dispatches of the last admissions, still unconfirmed
                await asyncio.wait(self._sending)

    async def accept(self, batch: Sequence[AbstractIncomingMessage]) -> list[Task]:
        """Admit a batch of submissions; returns the tasks it made Ready.

        Whatever cannot be read, validated or stored is dead-lettered alone with its reason,
        and the rest of the batch is admitted. A statement that fails for a reason of one row
        is retried on halves of the batch until that row is found. Only a server being away (a
        transient error) hands the whole batch back to RabbitMQ, to be delivered again.
        """
        try:
            refused: list[Refusal] = []
            subs: list[_Submission] = []
            seen: dict[UUID, _Submission] = {}

            def take(sub: _Submission) -> None:
                first = seen.get(sub.accepted.task_id)
                if first is None:
                    seen[sub.accepted.task_id] = sub
                    subs.append(sub)
                elif not same_spec(first.accepted.spec.model_dump_json(), sub.accepted.spec):
                    # one task id twice in a batch (a duplicated message, a reused key)
                    refused.append(sub.refused(_conflict(sub.accepted)))

            for message in batch:
                if message.routing_key == WORKFLOW_KEY:
                    reason = await self._accept_workflow(message)
                    if reason is not None:
                        refused.append(Refusal.of(message, reason))
                    continue
                judged = self._judge(message)
                if isinstance(judged, Refusal):
                    refused.append(judged)
                    continue
                entries, key = judged
                for e in entries:
                    if isinstance(e.verdict, Rejected):
                        refused.append(_refusal(e, key, e.verdict.reason))
                    else:
                        take(_Submission(e.verdict, e, key))
            # batch messages carry many tasks each: one admission statement takes at most
            # SKED_SUBMIT_BATCH of them, as it would take single ones
            ready, failed = [], []
            step = self.settings.submit_batch
            for i in range(0, len(subs), step):
                some, refused_here = await self._admit_isolating(subs[i : i + step])
                ready += some
                failed += refused_here
            for refusal in [*refused, *failed]:
                log.warning("dead-lettering a submission: %s", refusal.reason)
                await self.bus.dead_letter(
                    refusal.body,
                    refusal.reason,
                    refusal.routing_key,
                    {"x-sked-message-id": refusal.message_id},
                )
            hooks.refused(len(refused) + len(failed))
        except TRANSIENT as exc:
            # Postgres, Redis or RabbitMQ is away: hand the batch back to RabbitMQ to deliver
            # again (if the channel itself is gone, RabbitMQ requeues it anyway)
            with contextlib.suppress(*TRANSIENT):
                await batch[-1].nack(multiple=True, requeue=True)
            if isinstance(exc, REDIS_AWAY):
                self.hub.redis_away.set()  # and take no more until it answers (service.py)
            raise
        await batch[-1].ack(multiple=True)
        return ready

    def _judge(self, message: AbstractIncomingMessage) -> tuple[list[Entry], str] | Refusal:
        """The tasks of a message, each judged, and the routing key a refused one goes to the
        dead letters under; or the refusal of the whole message (a malformed batch)."""
        limit, policy = self.settings.max_message_bytes, self.policy
        if message.routing_key == BATCH_KEY:  # many tasks, each judged alone
            entries = judge_batch(message.body, message.content_type, limit, policy)
            if isinstance(entries, Rejected):
                return Refusal.of(message, entries.reason)
            return entries, SUBMIT_KEY
        mid = message.message_id
        verdict = judge(message.body, message.content_type, mid, limit, policy)
        entry = Entry(verdict, message.body, mid or "", traceparent(message.headers))
        return [entry], message.routing_key or ""

    async def _admit_isolating(self, subs: list[_Submission]) -> Admitted:
        """Admit `subs`; the one submission whose admission fails alone is refused with the
        error. Admission is idempotent (task ids), so retrying what was admitted changes nothing."""
        if not subs:
            return [], []

        async def refuse(sub: _Submission, exc: Exception) -> Admitted:
            log.exception("submission %s cannot be admitted", sub.accepted.task_id)
            return [], [sub.refused(f"cannot be admitted: {one_line(exc)}")]

        def merge(a: Admitted, b: Admitted) -> Admitted:
            return a[0] + b[0], a[1] + b[1]

        return await isolate(subs, self._admit_submissions, refuse, merge)

    async def _admit_submissions(self, subs: Sequence[_Submission]) -> Admitted:
        task_ids = [s.accepted.task_id for s in subs]
        parents = [s.entry.traceparent for s in subs]
        contexts, handles = hooks.received(SUBMIT_QUEUE, task_ids, parents)
        try:
            ready, existing = await self.admit([s.accepted.spec for s in subs], task_ids, contexts)
        finally:
            hooks.finished(handles)
        # a task id that named a task already: the same submission again is harmless; another
        # spec under the same idempotency key (or message id) is refused, not swallowed, and
        # so is a key held by a task of another id (a workflow's): the id the producer was
        # given would name no task
        refused = [
            s.refused(_conflict(s.accepted, found))
            for s in subs
            if (found := existing.get(s.accepted.task_id)) is not None
            and (found.id != s.accepted.task_id or not same_spec(found.spec_json, s.accepted.spec))
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
        self.hub.work_arrived()
        log.info("workflow %s (%s): %d tasks", workflow_id, spec.name, len(spec.tasks))
        return None

    async def admit(
        self,
        specs: Sequence[TaskSpec],
        ids: Sequence[UUID],
        traceparents: Sequence[str | None] | None = None,
    ) -> tuple[list[Task], dict[UUID, Task]]:
        """Create tasks and walk the new ones Created -> Pending -> Ready (one statement).
        Returns the new tasks (Ready, or placed already), and the tasks that existed already,
        by the id each was asked for under (a task found by its idempotency key may have
        another).

        When nothing is queued ahead of them (nor asked back in line: Hub.returns_pending),
        they are placed by the same statement and skip
        the Redis queue: no older or higher task waits, so the order is the same, and a
        submission reaches its node in one round trip and one commit. The placement is
        planned here on the nodes as read lately, without their locks (services.scheduler.
        ahead); the statement locks the planned nodes and places a task only where its node
        still has room for everything planned there (sked_admit), so nothing is overcommitted
        when the nodes changed meanwhile: what did not fit waits in line.
        """
        if not specs:
            return [], {}
        ends, hub = self.hub.ends, self.hub
        view = self._view
        if view is not None and view.fresh(hub.node_changes):
            queued = await self.queue.waiting()
        else:
            generation = hub.node_changes
            queued, (rows, mode) = await both(self.queue.waiting(), self.store.nodes.read())
            view = self._view = NodeView(rows, mode, generation, hub.routable)
        if queued is None:  # Redis lost the line: what was in it is back once it is rebuilt
            hub.rebuild.set()
        placing: Placing | None = None
        unplaced: dict[UUID, Choice] = {}
        needs: dict[UUID, Need] = {}
        # nothing in line, nor on its way back to it: a parked task that fits since a node
        # changed is older or higher, and takes the slot first
        if queued == 0 and not hub.returns_pending():
            placing, unplaced, needs = view.plan(specs, ids, ADMISSION, self.store.node_ttl_s)
        hub.admitting(dict.fromkeys(ids, fsm.walked_version(ADMISSION)))
        admitted = await self.store.tasks.admit_many(specs, ids, ADMISSION, traceparents, placing)
        new = [a[0] for a in admitted if a is not None and a[1]]
        existing = {i: a[0] for i, a in zip(ids, admitted, strict=True) if a and not a[1]}
        gone = [i for i, a in zip(ids, admitted, strict=True) if a is None]
        if gone:  # its message again (a redelivery, a replay): not run twice
            log.info(
                "%d submissions ran already and retention deleted them (%s, ...)",
                len(gone),
                gone[0],
            )
        hub.forget_admitting([*existing, *gone])
        moved = [t for t in new if t.status is State.SCHEDULING]
        ready = [t for t in new if t.status is State.READY]
        view.placed(moved, needs)
        if any(t.id in needs for t in ready):
            self._view = None  # a node refused its plan: the view was wrong
        waiting = {t.id: unplaced.get(t.id) or Choice(None, fits_later=True) for t in ready}
        await self.dispatcher.queue_waiting(ready, waiting, ends, nodes=view.generation)
        await self._send_soon(moved)
        if waiting:
            hub.work_arrived()
        return new, existing

    async def _send_soon(self, moved: list[Task]) -> None:
        """The dispatch messages of what was just placed: those whose nodes the commit told
        wait for the follower (`follow.py`: most are claimed from the notification, and then
        need none); the rest are sent now.

        Sent without waiting for RabbitMQ's confirms: the next submissions are admitted
        meanwhile. Alone at 100 tasks/s the confirm was a third of a submission's admission,
        and the next one queued behind it. Nothing waits
        for it that needs to: the placement is committed (a submission redelivered now finds
        its task and places nothing again), and a dispatch that is not confirmed is taken back
        to Ready by `send` itself. At most MAX_SENDING are in flight; the tasks left waiting
        were queued before, so a later submission cannot pass them."""
        moved = self.follower.hold(moved)
        if not moved:
            return
        while len(self._sending) >= MAX_SENDING:
            await asyncio.wait(self._sending, return_when=asyncio.FIRST_COMPLETED)
        sending = asyncio.create_task(self._send(moved))
        self._sending.add(sending)
        sending.add_done_callback(self._sending.discard)

    async def _send(self, moved: list[Task]) -> None:
        try:
            await self.dispatcher.send(moved)
        except TRANSIENT as exc:
            # taken back to Ready by send(); the broken connection stops this loop too
            log.warning("dispatches of %d placed tasks not confirmed: %s", len(moved), exc)
        except Exception:  # a bug: the attempts stay Scheduling until recovery's stuck sweep
            log.exception("sending the dispatches of %d placed tasks failed", len(moved))


def _conflict(accepted: Accepted, existing: Task | None = None) -> str:
    key = accepted.spec.idempotency_key
    named = f"idempotency key {key!r}" if key is not None else "its message id"
    if existing is not None and existing.workflow_id is not None:
        return (
            f"{named} already names task {existing.id}, task {existing.wf_task!r} of workflow "
            f"{existing.workflow_id}: a key stands for one task; use a new one for this task"
        )
    where = f"task {existing.id}" if existing is not None else f"task {accepted.task_id}"
    return (
        f"{named} already names {where}, submitted with a different spec: a key (or message "
        f"id) stands for one task; use a new one for a different task"
    )
