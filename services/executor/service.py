"""The executor's loops: start dispatched attempts, renew their leases, report their outcomes.

start   dispatches from this node's queue (prefetch = slots, so RabbitMQ never hands this node
        more attempts than it has slots), in batches: CAS Scheduling -> Running first (which
        takes the attempt's lease), then start the process. Claiming before starting is what
        makes a redelivered dispatch harmless: its CAS loses, so an attempt never starts twice.
renew   every beat period, one statement renews the lease of every attempt here; each renewal
        Postgres confirms lets the node's watchdog run the attempt a lease longer. Without
        renewals (this process frozen, cut off, or Postgres away) the watchdog freezes the
        attempt on its own; a renewal thaws it; a refused one (the task moved on) kills it.
finish  outcomes in batches, in one transaction: Running -> Success | Failed | TimedOut, and
        Failed/TimedOut -> RetryWait while retries remain. Only then is the dispatch
        acknowledged.
beat    refresh this node's row; a node silent for SKED_NODE_TTL_S gets no new work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from uuid import UUID, uuid4

from aio_pika.abc import AbstractIncomingMessage
from pydantic import ValidationError

from services.executor.backends import Backend, Key, Launch, Outcome
from shared import fsm, heartbeat, hooks, lease
from shared.bus import PROBE_EXCHANGE, AmqpBus
from shared.errors import one_line
from shared.fsm import State
from shared.models import Dispatch, Task
from shared.outcome import Report, end_move, retries, storable
from shared.policy import JobPolicy
from shared.queues import ReadyQueue
from shared.resilience import TRANSIENT, retrying, supervise
from shared.runtime import next_batch, wait_any
from shared.settings import Settings
from shared.store import TASK_CHANNEL, Store, parse_notify

log = logging.getLogger(__name__)

# A move into one of these, made by someone else, takes a running attempt away from this node.
TAKEN_AWAY = {s.value for s in (State.PAUSED, State.CANCELED, State.LOST, State.RETRY_WAIT)}


@dataclass
class Attempt:
    task: Task  # as it stood after this executor's Scheduling -> Running CAS
    message: AbstractIncomingMessage
    # monotonic time before the statement that last renewed its lease was sent
    renewed_at: float = 0.0


class Executor:
    """One executor process is one node."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        bus: AmqpBus,
        backend: Backend,
        queue: ReadyQueue,
    ) -> None:
        self.settings = settings
        self.secret = settings.require_heartbeat_secret()
        self.node_id = settings.node_id
        self.store = store
        self.bus = bus
        self.backend = backend
        self.queue = queue
        self.policy = JobPolicy.of(settings.allowed_handlers, settings.allowed_commands)
        self.boot_id = uuid4()  # this incarnation: the owner of the leases it takes
        self.active: dict[Key, Attempt] = {}
        # outcomes known here but not yet written: a probe gets the real outcome from these
        self.unreported: dict[Key, Outcome] = {}
        self._inbox: asyncio.Queue[AbstractIncomingMessage | None] = asyncio.Queue()
        self._outcomes: asyncio.Queue[tuple[Attempt, Outcome] | None] = asyncio.Queue()
        self._runs: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._look = asyncio.Event()  # the watch loop has suspects to check
        self._suspects: set[UUID] = set()
        self._leases = store.lease_link()
        self.ready = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        s = self.settings
        await self.backend.start()
        channel = await self.bus.consumer_channel(prefetch=s.slots)
        queue = await self.bus.declare_node_queue(channel, self.node_id)
        await self.store.nodes.register(
            self.node_id,
            s.slots,
            s.node_cpu,
            s.node_memory_mb,
            s.node_gpu,
            s.node_labels,
            self.boot_id,
        )
        listener = self.store.listener(
            [(TASK_CHANNEL, self._on_task_notify)], on_reconnect=self._look.set
        )
        probes = await channel.declare_queue(exclusive=True, auto_delete=True)
        await probes.bind(PROBE_EXCHANGE, self.node_id)
        await probes.consume(self._on_probe)
        tag = await queue.consume(self._inbox.put)
        log.info(
            "executor %s ready: %d slots, cpu %g, memory %d MB, gpu %d, labels %s",
            self.node_id,
            s.slots,
            s.node_cpu,
            s.node_memory_mb,
            s.node_gpu,
            s.node_labels,
        )
        self.ready.set()
        try:
            stop = self._stopping
            async with asyncio.TaskGroup() as group:
                group.create_task(listener.run(stop))
                # start and finish retry their Postgres writes until they land, so a batch is
                # not dropped by an outage; the supervisor covers the rest (a lost channel)
                group.create_task(supervise("start", self._start_loop, stop))
                group.create_task(supervise("finish", self._finish_loop, stop))
                group.create_task(supervise("node heartbeat", self._beat_loop, stop))
                group.create_task(supervise("watch", self._watch_loop, stop))
                group.create_task(self._renew_loop())
                # the node's warden gone means its attempts are gone: stop, loudly
                watch = group.create_task(self.backend.watch())
                await stop.wait()
                # stop taking work, let what runs finish (bounded), then stop the rest
                with contextlib.suppress(*TRANSIENT):
                    await self.store.nodes.set_ready(self.node_id, self.boot_id, False)
                    await queue.cancel(tag)
                await self._drain_runs()
                self._outcomes.put_nowait(None)
                watch.cancel()
        finally:
            with contextlib.suppress(*TRANSIENT):
                await channel.close()
            self._leases.close()
            await self.backend.close()

    def stop(self) -> None:
        if not self._stopping.is_set():
            log.info("executor %s stopping", self.node_id)
        self._stopping.set()
        self._inbox.put_nowait(None)

    async def _drain_runs(self) -> None:
        if self._runs:
            await asyncio.wait(self._runs, timeout=self.settings.shutdown_grace_s)
        for task_id, attempt in list(self.backend.running()):
            await self.backend.stop_task(task_id, attempt)
        if self._runs:
            await asyncio.wait(self._runs, timeout=10)

    async def _dead_letter(self, message: AbstractIncomingMessage, reason: str) -> None:
        """A message this node cannot use goes to `sked.dead` with the reason, alone."""
        log.warning("dead-lettering a message from %s: %s", message.routing_key, reason)
        await self.bus.dead_letter(message.body, reason, message.routing_key or "")
        await _ack(message)

    # -- start --------------------------------------------------------------------------------

    async def _start_loop(self) -> None:
        while (batch := await next_batch(self._inbox)) is not None:
            await self.start(batch)
        await self._hand_back_unstarted()

    async def start(self, batch: list[AbstractIncomingMessage]) -> int:
        """Claim and start a batch of dispatches; returns how many attempts started here."""
        fresh: dict[UUID, tuple[Dispatch, AbstractIncomingMessage]] = {}
        for message in batch:
            try:
                dispatch = Dispatch.model_validate_json(message.body)
            except ValidationError as exc:  # only a bug or a foreign publisher does this
                await self._dead_letter(message, f"unreadable dispatch: {exc}")
                continue
            if dispatch.node != self.node_id:
                await self._dead_letter(message, f"a dispatch for node {dispatch.node!r}")
                continue
            key = (dispatch.task_id, dispatch.attempt)
            if key in self.active:
                # redelivered after a reconnect while it still runs: acknowledge via this copy
                self.active[key].message = message
                continue
            older = fresh.get(dispatch.task_id)
            if older is not None:
                # the same task twice in one batch: the higher attempt is the live one (the
                # older was superseded), and a copy of the same attempt is a duplicate
                stale, keep = sorted([older, (dispatch, message)], key=lambda d: d[0].attempt)
                await _ack(stale[1])
                fresh[dispatch.task_id] = keep
                continue
            fresh[dispatch.task_id] = (dispatch, message)
        return await self._claim_isolating(list(fresh.values()))

    async def _claim_isolating(
        self, dispatches: list[tuple[Dispatch, AbstractIncomingMessage]]
    ) -> int:
        """Claim the dispatches; a statement that fails for a reason of one of them (not a
        server away) is retried on halves, and the dispatch that fails alone dead-lettered."""
        if not dispatches:
            return 0
        try:
            return await self._claim(dispatches)
        except TRANSIENT:
            raise
        except Exception as exc:
            if len(dispatches) == 1:
                log.exception("dispatch %s cannot be claimed", dispatches[0][0].task_id)
                await self._dead_letter(dispatches[0][1], f"cannot be claimed: {one_line(exc)}")
                return 0
            half = len(dispatches) // 2
            return await self._claim_isolating(dispatches[:half]) + await self._claim_isolating(
                dispatches[half:]
            )

    async def _claim(self, dispatches: list[tuple[Dispatch, AbstractIncomingMessage]]) -> int:
        reason = f"started on {self.node_id}"
        moves = [
            fsm.plan(d, State.RUNNING, reason, lease_owner=str(self.boot_id)) for d, _ in dispatches
        ]
        claimed: list[Task] = []
        tries = 0
        sent_at = time.monotonic()  # before the first try: its COMMIT may be the one that held

        async def claim() -> None:
            nonlocal tries
            tries += 1
            claimed[:] = await self.store.tasks.transition_many(moves)

        if not await retrying("start", claim, self._stopping):
            return 0  # shutting down with Postgres away: the dispatches are redelivered
        won = {t.id: t for t in claimed}
        lost = [d for d, _ in dispatches if d.task_id not in won]
        if lost and tries > 1:
            # A try whose COMMIT went through but whose reply was lost makes the next try lose
            # to it: a task Running in this attempt under this incarnation's lease is ours.
            for task in await self.store.tasks.get_many([d.task_id for d in lost]):
                mine = task.status is State.RUNNING and task.lease_owner == self.boot_id
                if mine and any(d.task_id == task.id and d.attempt == task.attempt for d in lost):
                    won[task.id] = task
        messages = {d.task_id: m for d, m in dispatches}
        for dispatch, message in dispatches:
            if dispatch.task_id not in won:
                log.info(
                    "dispatch of %s attempt %d is stale (the task moved on); dropped",
                    dispatch.task_id,
                    dispatch.attempt,
                )
                await _ack(message)
        for task in won.values():
            message = messages[task.id]
            attempt = Attempt(task, message, sent_at)
            self.active[(task.id, task.attempt)] = attempt
            run = asyncio.create_task(self._run(attempt))
            self._runs.add(run)
            run.add_done_callback(self._runs.discard)
        return len(won)

    async def _run(self, attempt: Attempt) -> None:
        task = attempt.task
        with hooks.attempt(task, self.node_id, attempt.message.headers) as seen:
            refused = self.policy.refuses(task.spec.job)
            if refused:  # the scheduler checks too; this node does not take its word for it
                outcome = Outcome.failed(refused)
            else:
                env = {
                    "SKED_HEARTBEAT_URL": self.settings.heartbeat_url,
                    "SKED_HEARTBEAT_TOKEN": heartbeat.token(self.secret, task.id, task.attempt),
                }
                lease_s = lease.remaining_s(
                    task.heartbeat_timeout_s, attempt.renewed_at, time.monotonic()
                )
                outcome = await self.backend.run(
                    Launch(
                        task.id,
                        task.attempt,
                        task.spec.job,
                        task.timeout_s,
                        env,
                        task.inputs,
                        lease_s,
                    )
                )
            seen.ended(outcome.ok, outcome.error)
        self.unreported[(task.id, task.attempt)] = outcome
        await self._outcomes.put((attempt, outcome))

    async def _hand_back_unstarted(self) -> None:
        """On shutdown, dispatches received but not started go back to Ready at once."""
        while not self._inbox.empty():
            message = self._inbox.get_nowait()
            if message is None:
                continue
            try:
                dispatch = Dispatch.model_validate_json(message.body)
            except ValidationError:
                await _ack(message)
                continue
            # best effort: if a server is away, recovery's stuck-in-Scheduling sweep does it
            with contextlib.suppress(*TRANSIENT):
                moved = await self.store.tasks.transition(
                    fsm.plan(dispatch, State.READY, f"node {self.node_id} shut down before start")
                )
                if moved is not None:
                    await self.queue.push([moved])
            await _ack(message)

    # -- leases -------------------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        """Renew every attempt's lease each period, whatever happens: a failure is logged and
        the next period tries again (the watchdog freezes what is not renewed in time)."""
        while not self._stopping.is_set():
            period = lease.renew_every_s(
                self.settings.node_heartbeat_s,
                [a.task.heartbeat_timeout_s for a in self.active.values()],
            )
            await wait_any(self._stopping, timeout=period)
            try:
                await self.renew_once(timeout=period)
            except Exception as exc:  # the next period tries again; the watchdog covers a gap
                log.warning("lease renewal failed: %s", one_line(exc))

    async def renew_once(self, timeout: float = 2.0) -> int:
        """One renewal of every lease held here; returns how many Postgres renewed.

        On a link of its own (store.LeaseLink), dropped on a timeout: a partition that swallows
        packets must not leave a renewal hanging while the watchdog's clock runs."""
        keys = list(self.active)
        if not keys:
            return 0
        sent_at = time.monotonic()
        renewed = await self._leases.renew(self.boot_id, keys, max(timeout, 0.5))
        now = time.monotonic()
        for key in keys:
            attempt = self.active.get(key)
            if attempt is None:
                continue
            if key in renewed:
                attempt.renewed_at = sent_at
                timeout_s = attempt.task.heartbeat_timeout_s
                self.backend.renew(key, lease.remaining_s(timeout_s, sent_at, now))
            else:
                # Postgres says it is not ours any more (paused, canceled, lost and retried):
                # the watch loop stops it, and its lease is given back once it is gone
                self._suspects.add(key[0])
                self._look.set()
        return len(renewed)

    # -- finish -------------------------------------------------------------------------------

    async def _finish_loop(self) -> None:
        linger = self.settings.finish_linger_s
        while (batch := await next_batch(self._outcomes, linger=linger)) is not None:
            await self.finish(batch)

    async def finish(self, batch: list[tuple[Attempt, Outcome]]) -> None:
        """Write a batch of outcomes; retried until Postgres takes it (an outcome is never
        dropped: the dispatch stays unacknowledged until it is written)."""
        reports = {(a.task.id, a.task.attempt): storable(_report(o)) for a, o in batch}
        # one task's older attempt beside its newer one: the older was superseded
        newest: dict[UUID, Attempt] = {}
        for attempt, _ in batch:
            kept = newest.get(attempt.task.id)
            if kept is None or attempt.task.attempt > kept.task.attempt:
                newest[attempt.task.id] = attempt
        current = [(a, reports[(a.task.id, a.task.attempt)]) for a in newest.values()]
        superseded = [
            (a, reports[(a.task.id, a.task.attempt)])
            for a, _ in batch
            if newest[a.task.id] is not a
        ]
        late: list[tuple[Task, Report]] = []

        async def write() -> None:
            late[:] = await self._write_isolating(current, superseded)

        if not await retrying("finish", write, self._stopping):
            return  # shutting down with Postgres away: the heartbeat-monitor will find them
        for task, report in late:
            log.info(
                "outcome of %s attempt %d recorded, not applied (the task moved on): ok=%s",
                task.id,
                task.attempt,
                report.ok,
                extra={"task_id": str(task.id), "attempt": task.attempt},
            )
        for attempt, _ in batch:
            self.active.pop((attempt.task.id, attempt.task.attempt), None)
            self.unreported.pop((attempt.task.id, attempt.task.attempt), None)
            await _ack(attempt.message)

    async def _write_isolating(
        self, current: list[tuple[Attempt, Report]], superseded: list[tuple[Attempt, Report]]
    ) -> list[tuple[Task, Report]]:
        """Write the outcomes; if the batch fails for a reason of one outcome (not a server
        away), write halves apart, and the one outcome that cannot be written is replaced
        by a failure saying why: that task fails, the rest of the batch lands."""
        try:
            return await self._write_outcomes(current, superseded)
        except TRANSIENT:
            raise
        except Exception as exc:
            if len(current) + len(superseded) <= 1:
                (attempt, _), *_ = current or superseded
                log.exception("the outcome of %s cannot be written", attempt.task.id)
                why = Report(ok=False, error=f"outcome could not be stored: {one_line(exc)}")
                plain = [(attempt, storable(why))]
                return await self._write_outcomes(
                    plain if current else [], plain if superseded else []
                )
            if len(current) > 1:
                half = len(current) // 2
                return [
                    *await self._write_isolating(current[:half], superseded),
                    *await self._write_isolating(current[half:], []),
                ]
            half = len(superseded) // 2
            return [
                *await self._write_isolating(current, superseded[:half]),
                *await self._write_isolating([], superseded[half:]),
            ]

    async def _write_outcomes(
        self, current: list[tuple[Attempt, Report]], superseded: list[tuple[Attempt, Report]]
    ) -> list[tuple[Task, Report]]:
        where = f"on {self.node_id}"
        reason = f"ended {where}"
        ends = [end_move(a.task, r, reason) for a, r in current]
        async with self.store.transaction() as tx:
            ended = await tx.tasks.transition_many(ends)
            await tx.tasks.transition_many(retries(ended))
            won = {t.id for t in ended}
            late = [(a.task, r) for a, r in current if a.task.id not in won]
            if late:
                # a retry of a write whose COMMIT went through but whose reply was lost loses
                # its CAS to itself: that outcome is applied already, not late
                mine = await tx.tasks.ended_with([(t.id, t.version) for t, _ in late], reason)
                late = [(t, r) for t, r in late if t.id not in mine]
            late += [(a.task, r) for a, r in superseded]
            # the task moved on (canceled, paused, lost and retried): keep, do not apply
            await tx.late.record(
                [
                    (t.id, t.attempt, r.ok, r.result, r.error, f"attempt superseded {where}")
                    for t, r in late
                ]
            )
            # their processes are gone: a next attempt need not wait for their leases to lapse
            await tx.leases.release(self.boot_id, [(t.id, t.attempt) for t, _ in late])
        return late

    # -- watching what runs here -------------------------------------------------------------

    def _on_task_notify(self, _c: object, _p: int, _ch: str, payload: str) -> None:
        notice = parse_notify(payload)
        if not notice.states & TAKEN_AWAY:
            return
        if notice.ids is None:
            self._suspects.update(task_id for task_id, _ in self.active)
        else:
            self._suspects.update(notice.ids & {task_id for task_id, _ in self.active})
        if self._suspects:
            self._look.set()

    async def _watch_loop(self) -> None:
        """Stop attempts whose task is no longer Running in that attempt here: paused or
        canceled by an operator, or declared lost and retried elsewhere. Woken by the NOTIFY of
        such a move and by a lease renewal Postgres refused (so a missed NOTIFY costs at most a
        renewal period). The dispatch stays unacknowledged until the process is gone, so this
        node never runs more processes than it has slots."""
        while not self._stopping.is_set():
            await wait_any(self._look, self._stopping)
            self._look.clear()
            suspects, self._suspects = self._suspects, set()
            mine = [(i, a) for i, a in self.active if i in suspects]
            if not mine:
                continue
            current = {t.id: t for t in await self.store.tasks.get_many([i for i, _ in mine])}
            for task_id, attempt in mine:
                task = current.get(task_id)
                if task is None or (task.status is State.RUNNING and task.attempt == attempt):
                    continue
                why = "gone" if task is None else f"{task.status.label} (attempt {task.attempt})"
                if await self.backend.stop_task(task_id, attempt):
                    log.info(
                        "stopped %s attempt %d: the task is now %s",
                        task_id,
                        attempt,
                        why,
                        extra={"task_id": str(task_id), "attempt": attempt},
                    )

    # -- node heartbeat -----------------------------------------------------------------------

    async def _beat_loop(self) -> None:
        while not self._stopping.is_set():
            await wait_any(self._stopping, timeout=self.settings.node_heartbeat_s)
            if self._stopping.is_set():
                return
            load = len(self.active) / self.settings.slots
            if not await self.store.nodes.heartbeat(self.node_id, self.boot_id, load):
                log.error("node %s was taken over by another executor; stopping", self.node_id)
                self.stop()
                return

    # -- answering the heartbeat-monitor -------------------------------------------------------

    async def _on_probe(self, message: AbstractIncomingMessage) -> None:
        """A monitor asks about one attempt whose lease lapsed: is it still running here, did
        it finish (and how), is it frozen, or does this node not know it? A probe this node
        cannot read is dead-lettered; nothing a probe holds can stop the executor."""
        try:
            probe = heartbeat.Probe.model_validate_json(message.body)
        except ValidationError as exc:
            with contextlib.suppress(*TRANSIENT):
                await self._dead_letter(message, f"unreadable probe: {exc}")
            return
        try:
            key = (probe.task_id, probe.attempt)
            if key in self.unreported:
                report = storable(_report(self.unreported[key]))
                answer = heartbeat.ProbeAnswer(state="finished", report=report)
            elif self.backend.frozen(key):
                answer = heartbeat.ProbeAnswer(state="frozen")
            elif key in self.backend.running():
                answer = heartbeat.ProbeAnswer(state="running")
            else:
                answer = heartbeat.ProbeAnswer(state="unknown")
            if message.reply_to:
                await self.bus.reply(message, answer.model_dump_json().encode())
        except Exception:  # an answer that cannot be sent is no answer: the ladder copes
            log.exception("probe of %s attempt %d not answered", probe.task_id, probe.attempt)
        await _ack(message)


async def _ack(message: AbstractIncomingMessage) -> None:
    """Acknowledge; if the channel is gone, RabbitMQ requeues the message, and its second
    delivery finds the task moved on and is dropped — so a failed ack loses nothing."""
    with contextlib.suppress(*TRANSIENT):
        await message.ack()


def _report(outcome: Outcome) -> Report:
    return Report(
        ok=outcome.ok,
        result=outcome.result,
        error=outcome.error,
        timed_out=outcome.timed_out,
        log_tail=outcome.log_tail,
    )
