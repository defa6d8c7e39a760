"""The executor's loops: start dispatched attempts, report their outcomes, heartbeat as a node.

start   dispatches from this node's queue (prefetch = slots, so RabbitMQ never hands this node
        more attempts than it has slots), in batches: CAS Scheduling -> Running first, then
        start the process. Claiming before starting is what makes a redelivered dispatch
        harmless: its CAS loses, so an attempt is never started twice.
finish  outcomes in batches, in one transaction: Running -> Success | Failed | TimedOut, and
        Failed/TimedOut -> RetryWait (capped exponential backoff with jitter) while retries
        remain. Only then is the dispatch acknowledged.
beat    refresh this node's row; a node silent for SKED_NODE_TTL_S gets no new work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from uuid import UUID, uuid4

from aio_pika.abc import AbstractIncomingMessage
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from services.executor.backend import Launch, LocalBackend, Outcome
from shared import fsm, heartbeat, telemetry
from shared.bus import HEARTBEATS_EXCHANGE, PROBE_EXCHANGE, AmqpBus, Outgoing, node_queue
from shared.fsm import State
from shared.models import Dispatch, Task
from shared.nodes import PgNodeRepo
from shared.outcome import Report, end_move, retries
from shared.queues import ReadyQueue
from shared.repo import TASK_CHANNEL, PgTaskRepo, parse_notify
from shared.resilience import TRANSIENT, PgListener, retrying, supervise
from shared.runtime import next_batch, wait_any
from shared.settings import Settings

log = logging.getLogger(__name__)

# A move into one of these, made by someone else, takes a running attempt away from this node.
TAKEN_AWAY = {s.value for s in (State.PAUSED, State.CANCELED, State.LOST, State.RETRY_WAIT)}


@dataclass
class Attempt:
    task: Task  # as it stood after this executor's Scheduling -> Running CAS
    message: AbstractIncomingMessage
    trace: Context | None = None  # the dispatch's consumer span, parent of the run span


class Executor:
    """One executor process is one node."""

    def __init__(
        self,
        settings: Settings,
        repo: PgTaskRepo,
        nodes: PgNodeRepo,
        bus: AmqpBus,
        backend: LocalBackend,
        queue: ReadyQueue,
    ) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.repo = repo
        self.nodes = nodes
        self.bus = bus
        self.backend = backend
        self.queue = queue
        self.boot_id = uuid4()
        self.active: dict[tuple[UUID, int], Attempt] = {}
        # outcomes known here but not yet written: a probe gets the real outcome from these
        self.unreported: dict[tuple[UUID, int], Outcome] = {}
        self._beat_seq = 0
        self._inbox: asyncio.Queue[AbstractIncomingMessage | None] = asyncio.Queue()
        self._outcomes: asyncio.Queue[tuple[Attempt, Outcome] | None] = asyncio.Queue()
        self._runs: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._look = asyncio.Event()  # the watch loop has suspects to check
        self._suspects: set[UUID] = set()
        self.ready = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        s = self.settings
        await self.backend.start()
        channel = await self.bus.consumer_channel(prefetch=s.slots)
        queue = await self.bus.declare_node_queue(channel, self.node_id)
        await self.nodes.register(
            self.node_id,
            s.slots,
            s.node_cpu,
            s.node_memory_mb,
            s.node_gpu,
            s.node_labels,
            self.boot_id,
        )
        listener = PgListener(
            s.database_url, [(TASK_CHANNEL, self._on_task_notify)], on_reconnect=self._look.set
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
                await stop.wait()
                # stop taking work, let what runs finish (bounded), then stop the rest
                with contextlib.suppress(*TRANSIENT):
                    await self.nodes.set_ready(self.node_id, self.boot_id, False)
                    await queue.cancel(tag)
                await self._drain_runs()
                self._outcomes.put_nowait(None)
        finally:
            with contextlib.suppress(*TRANSIENT):
                await channel.close()
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
                log.error("dropping an unreadable dispatch: %s", exc)
                await _ack(message)
                continue
            key = (dispatch.task_id, dispatch.attempt)
            if key in self.active:
                # redelivered after a reconnect while it still runs: acknowledge via this copy
                self.active[key].message = message
                continue
            if dispatch.task_id in fresh:
                await _ack(message)  # the same dispatch twice in one batch
                continue
            fresh[dispatch.task_id] = (dispatch, message)
        moves = [
            fsm.plan(d, State.RUNNING, f"started on {self.node_id}") for d, _ in fresh.values()
        ]
        claimed: list[Task] = []

        async def claim() -> None:
            claimed[:] = await self.repo.transition_many(moves)

        if not await retrying("start", claim, self._stopping):
            return 0  # shutting down with Postgres away: the dispatches are redelivered
        started = claimed
        won = {t.id for t in started}
        for dispatch, message in fresh.values():
            if dispatch.task_id not in won:
                log.info(
                    "dispatch of %s attempt %d is stale (the task moved on); dropped",
                    dispatch.task_id,
                    dispatch.attempt,
                )
                await _ack(message)
        for task in started:
            message = fresh[task.id][1]
            attempt = Attempt(task, message, self._received(task, message))
            self.active[(task.id, task.attempt)] = attempt
            run = asyncio.create_task(self._run(attempt))
            self._runs.add(run)
            run.add_done_callback(self._runs.discard)
        return len(started)

    def _received(self, task: Task, message: AbstractIncomingMessage) -> Context | None:
        """The consumer span of a dispatch (under the producer span in its headers)."""
        if not telemetry.enabled():
            return None
        received = telemetry.start(
            f"{node_queue(self.node_id)} receive",
            telemetry.extract(message.headers),
            SpanKind.CONSUMER,
            telemetry.messaging(node_queue(self.node_id), "receive", task.id, attempt=task.attempt),
        )
        received.end()
        return trace.set_span_in_context(received)

    async def _run(self, attempt: Attempt) -> None:
        task = attempt.task
        with telemetry.span(
            f"attempt {task.attempt} run",
            attempt.trace or task.traceparent,
            attributes={"sked.task_id": str(task.id), "sked.node": self.node_id},
        ) as span:
            env = {
                "SKED_HEARTBEAT_URL": self.settings.heartbeat_url,
                "SKED_HEARTBEAT_TOKEN": heartbeat.token(
                    self.settings.heartbeat_secret, task.id, task.attempt
                ),
            }
            outcome = await self.backend.run(
                Launch(task.id, task.attempt, task.spec.job, task.timeout_s, env, task.inputs)
            )
            span.set_attribute("sked.ok", outcome.ok)
            if outcome.error:
                span.set_attribute("sked.error", outcome.error)
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
                moved = await self.repo.transition(
                    fsm.plan(dispatch, State.READY, f"node {self.node_id} shut down before start")
                )
                if moved is not None:
                    await self.queue.push([moved])
            await _ack(message)

    # -- finish -------------------------------------------------------------------------------

    async def _finish_loop(self) -> None:
        linger = self.settings.finish_linger_s
        while (batch := await next_batch(self._outcomes, linger=linger)) is not None:
            await self.finish(batch)

    async def finish(self, batch: list[tuple[Attempt, Outcome]]) -> None:
        """Write a batch of outcomes; retried until Postgres takes it (an outcome is never
        dropped: the dispatch stays unacknowledged until it is written)."""
        late: list[tuple[Task, Outcome]] = []

        async def write() -> None:
            late[:] = await self._write_outcomes(batch)

        if not await retrying("finish", write, self._stopping):
            return  # shutting down with Postgres away: the heartbeat-monitor will find them
        for task, outcome in late:
            log.info(
                "outcome of %s attempt %d recorded, not applied (the task moved on): ok=%s",
                task.id,
                task.attempt,
                outcome.ok,
                extra={"task_id": str(task.id), "attempt": task.attempt},
            )
        for attempt, _ in batch:
            self.active.pop((attempt.task.id, attempt.task.attempt), None)
            self.unreported.pop((attempt.task.id, attempt.task.attempt), None)
            await _ack(attempt.message)

    async def _write_outcomes(
        self, batch: list[tuple[Attempt, Outcome]]
    ) -> list[tuple[Task, Outcome]]:
        where = f"on {self.node_id}"
        reason = f"ended {where}"
        ends = [end_move(a.task, _report(o), reason) for a, o in batch]
        async with self.repo.pool.acquire() as conn, conn.transaction():
            ended = await self.repo.transition_many(ends, conn)
            await self.repo.transition_many(retries(ended, datetime.now(UTC)), conn)
            won = {t.id for t in ended}
            late = [(a.task, o) for a, o in batch if a.task.id not in won]
            if late:
                # a retry of a write whose COMMIT went through but whose reply was lost loses
                # its CAS to itself: that outcome is applied already, not late
                mine = await self.repo.ended_with(
                    conn, [(t.id, t.version) for t, _ in late], reason
                )
                late = [(t, o) for t, o in late if t.id not in mine]
            # the task moved on (canceled, paused, lost and retried): keep, do not apply
            await self.repo.record_late_results(
                [
                    (t.id, t.attempt, o.ok, o.result, o.error, f"attempt superseded {where}")
                    for t, o in late
                ],
                conn,
            )
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
        such a move; every heartbeat period it also checks all of them, in case one was
        missed. The dispatch stays unacknowledged until the process is gone, so this node never
        runs more processes than it has slots."""
        while not self._stopping.is_set():
            woke = await wait_any(
                self._look, self._stopping, timeout=self.settings.node_heartbeat_s
            )
            self._look.clear()
            if woke:
                suspects, self._suspects = self._suspects, set()
            else:
                suspects = {task_id for task_id, _ in self.active}
            mine = [(i, a) for i, a in self.active if i in suspects]
            if not mine:
                continue
            current = {t.id: t for t in await self.repo.get_many([i for i, _ in mine])}
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
            if not await self.nodes.heartbeat(self.node_id, self.boot_id, load):
                log.error("node %s was taken over by another executor; stopping", self.node_id)
                self.stop()
                return
            await self.beat(load)

    async def beat(self, load: float) -> None:
        """Heartbeat for this node and every attempt it supervises, in one message."""
        seq = max(heartbeat.now_seq(), self._beat_seq + 1)  # never repeats, even if the clock
        self._beat_seq = seq  # steps back
        message = heartbeat.BeatMessage(
            node=heartbeat.NodeBeat(id=self.node_id, boot_id=self.boot_id, load=load),
            beats=[
                heartbeat.Beat(task_id=task_id, attempt=attempt, seq=seq)
                for task_id, attempt in self.backend.running()
            ],
        )
        await self.bus.publish(
            HEARTBEATS_EXCHANGE, [Outgoing("", message.model_dump_json().encode())]
        )

    # -- answering the heartbeat-monitor -------------------------------------------------------

    async def _on_probe(self, message: AbstractIncomingMessage) -> None:
        """A monitor asks about one attempt whose heartbeats it lost: is it still running here,
        did it finish (and how), or does this node not know it?"""
        async with message.process():
            try:
                probe = heartbeat.Probe.model_validate_json(message.body)
            except ValidationError as exc:
                log.error("unreadable probe: %s", exc)
                return
            key = (probe.task_id, probe.attempt)
            if key in self.unreported:
                outcome = self.unreported[key]
                answer = heartbeat.ProbeAnswer(state="finished", report=_report(outcome))
            elif key in self.backend.running():
                answer = heartbeat.ProbeAnswer(state="running")
            else:
                answer = heartbeat.ProbeAnswer(state="unknown")
            if message.reply_to:
                await self.bus.reply(message, answer.model_dump_json().encode())


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
