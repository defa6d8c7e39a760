"""The heartbeat-monitor: takes heartbeats, and confirms a loss before anything is marked Lost.

take     beats from executors (queue `sked.heartbeats`) and from task processes (HTTP
         `POST /heartbeat`, bearer token per attempt); coalesced in memory per attempt and
         written every SKED_HEARTBEAT_FLUSH_S in one statement, fenced by attempt and sequence.
sweep    the deadline index (`tasks.hb_deadline`, partial on Running) gives the overdue
         attempts, leased with SKIP LOCKED so replicas share them; the loop sleeps until the
         earliest deadline (at most a second), never scanning every Running task.
ladder   overdue -> node still ready? grace to 2x the timeout -> ask the executor (probe):
         running -> restore the heartbeat; finished -> reconcile to its real outcome;
         no answer / unknown -> Running -> Lost. Each rung taken is in the event reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue
from aiohttp import web
from pamqp.commands import Basic
from pydantic import ValidationError

from shared import fsm, heartbeat
from shared.bus import HEARTBEATS_QUEUE, JSON, PROBE_EXCHANGE, AmqpBus
from shared.errors import one_line
from shared.fsm import State
from shared.heartbeat import Beat, BeatMessage, Evidence, ProbeAnswer, Rung, next_rung
from shared.models import Task
from shared.outcome import end_move, retries
from shared.resilience import TRANSIENT, supervise
from shared.runtime import wait_any
from shared.settings import Settings
from shared.store import NodeRow, Store

log = logging.getLogger(__name__)


class Unreachable:
    """No executor of the node is connected: its probe queue is gone with its connection."""


UNREACHABLE = Unreachable()

# How many distinct attempts one flush may carry; beyond it, heartbeats are shed (counted and
# logged) rather than let memory grow: the next beat of a shed attempt is as good.
MAX_PENDING = 100_000


class HeartbeatMonitor:
    def __init__(self, settings: Settings, store: Store, bus: AmqpBus) -> None:
        self.settings = settings
        self.secret = settings.require_heartbeat_secret()
        self.store = store
        self.bus = bus
        self._pending: dict[tuple[uuid.UUID, int], int] = {}  # (task, attempt) -> highest seq
        self.max_pending = MAX_PENDING
        self._wake_sweep = asyncio.Event()
        self._stopping = asyncio.Event()
        self._answers: dict[str, asyncio.Future[ProbeAnswer]] = {}
        self._reply_queue: AbstractQueue | None = None
        self.rungs: dict[tuple[uuid.UUID, int], list[str]] = {}
        self.stats = {"received": 0, "applied": 0, "not_applied": 0, "shed": 0, "refused": 0}
        self.ready = asyncio.Event()
        self.port = settings.monitor_port

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        channel = await self.bus.consumer_channel(prefetch=1000)
        beats = await channel.get_queue(HEARTBEATS_QUEUE)
        beats_tag = await beats.consume(self._on_beats)
        self._reply_queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await self._reply_queue.consume(self._on_answer, no_ack=True)
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.monitor_host, self.settings.monitor_port)
        await site.start()
        if runner.addresses:  # the port actually bound, when 0 asked for any free one
            self.port = runner.addresses[0][1]
        log.info(
            "heartbeat-monitor listening on http://%s:%d/heartbeat",
            self.settings.monitor_host,
            self.port,
        )
        self.ready.set()
        try:
            stop = self._stopping
            async with asyncio.TaskGroup() as group:
                group.create_task(supervise("heartbeat flush", self._flush_loop, stop))
                group.create_task(supervise("deadline sweep", self._sweep_loop, stop))
        finally:
            with contextlib.suppress(*TRANSIENT):
                await beats.cancel(beats_tag)
            await runner.cleanup()
            await _close(channel)

    def stop(self) -> None:
        self._stopping.set()

    # -- taking heartbeats --------------------------------------------------------------------

    def take(self, beats: list[Beat]) -> int:
        """Coalesce beats in memory (highest seq per attempt). Returns how many were shed."""
        shed = 0
        for beat in beats:
            key = (beat.task_id, beat.attempt)
            known = self._pending.get(key)
            if known is None and len(self._pending) >= self.max_pending:
                shed += 1
                continue
            if known is None or beat.seq > known:
                self._pending[key] = beat.seq
        self.stats["received"] += len(beats)
        self.stats["shed"] += shed
        return shed

    async def _on_beats(self, message: AbstractIncomingMessage) -> None:
        """Beats over RabbitMQ. A message that is not a valid BeatMessage (bad JSON, a field
        out of range, unknown fields) is dead-lettered with the reason; nothing stops this."""
        try:
            body = BeatMessage.model_validate_json(message.body)
        except ValidationError as exc:
            self.stats["refused"] += 1
            log.warning("dead-lettering a heartbeat message: %s", exc)
            with contextlib.suppress(*TRANSIENT):
                await self.bus.dead_letter(
                    message.body, f"unreadable heartbeat message: {exc}", message.routing_key or ""
                )
        else:
            self.take(body.beats)
        with contextlib.suppress(*TRANSIENT):
            await message.ack()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024)
        app.router.add_post("/heartbeat", self._http_beat)
        app.router.add_get("/healthz", self._healthz)
        return app

    async def _http_beat(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            self.stats["refused"] += 1
            return web.json_response({"error": "missing bearer token"}, status=401)
        try:
            beat = Beat.model_validate_json(await request.read())
        except ValidationError as exc:
            self.stats["refused"] += 1
            return web.json_response({"error": str(exc)}, status=400)
        if not heartbeat.token_ok(self.secret, beat.task_id, beat.attempt, auth[len("Bearer ") :]):
            self.stats["refused"] += 1
            log.warning(
                "heartbeat for %s attempt %d refused: bad token", beat.task_id, beat.attempt
            )
            return web.json_response({"error": "token does not match this attempt"}, status=403)
        shed = self.take([beat])
        if shed:
            return web.json_response({"accepted": False, "error": "overloaded"}, status=503)
        # accepted; whether it is applied (current attempt, newer sequence) is decided in bulk
        return web.json_response({"accepted": True}, status=202)

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True, **self.stats, "pending": len(self._pending)})

    async def flush(self) -> int:
        """Write the coalesced beats in one statement; returns how many were applied."""
        if not self._pending:
            return 0
        batch, self._pending = self._pending, {}
        try:
            applied = await self._apply_isolating([(t, a, s) for (t, a), s in batch.items()])
        except TRANSIENT:
            for key, seq in batch.items():  # keep them for the next flush
                if seq > self._pending.get(key, 0):
                    self._pending[key] = seq
            raise
        refused = len(batch) - applied
        self.stats["applied"] += applied
        self.stats["not_applied"] += refused
        if refused:
            # an older attempt, a replayed sequence, or a task that left Running meanwhile
            log.info("%d heartbeat(s) acknowledged but not applied (stale attempt or seq)", refused)
        return applied

    async def _apply_isolating(self, beats: list[tuple[uuid.UUID, int, int]]) -> int:
        """Apply beats; one the statement refuses for its own sake (not a server away) is
        found by halving the batch and dropped, so it can never block the others."""
        if not beats:
            return 0
        try:
            return len(await self.store.leases.apply_heartbeats(beats))
        except TRANSIENT:
            raise
        except Exception as exc:
            if len(beats) == 1:
                log.warning("heartbeat %s dropped: %s", beats[0], one_line(exc))
                return 0
            half = len(beats) // 2
            return await self._apply_isolating(beats[:half]) + await self._apply_isolating(
                beats[half:]
            )

    async def _flush_loop(self) -> None:
        while not self._stopping.is_set():
            await wait_any(self._stopping, timeout=self.settings.heartbeat_flush_s)
            await self.flush()

    # -- the deadline sweep and the ladder ------------------------------------------------------

    async def _sweep_loop(self) -> None:
        """Sweep overdue attempts, sleeping until the earliest deadline (at most a second).

        Deadlines are restarted — every Running attempt gets a heartbeat timeout from now
        before it is judged — when this loop starts, after it failed (Postgres away, or this
        monitor cut off from it), and when Postgres restarted meanwhile: executors could not
        renew in that time, and their attempts are not lost for it."""
        restart = True
        postgres_started: float | None = None
        while not self._stopping.is_set():
            try:
                if restart:
                    n = await self.store.leases.restart_deadlines()
                    log.info("deadlines restarted: %d Running attempt(s) get a timeout anew", n)
                    restart = False
                handled = await self.sweep_once()
                wait_s, started = await self.store.leases.next_deadline()
            except TRANSIENT:
                restart = True
                raise
            if postgres_started is not None and started != postgres_started:
                restart = True
            postgres_started = started
            if handled or restart:
                continue
            wait = 1.0 if wait_s is None else min(1.0, max(wait_s, 0.01))
            await wait_any(self._wake_sweep, self._stopping, timeout=wait)
            self._wake_sweep.clear()

    async def sweep_once(self) -> int:
        # beats that arrived up to now count before anything is judged overdue
        await self.flush()
        lease = self.settings.probe_timeout_s + 5.0
        overdue = await self.store.leases.overdue(100, lease)
        if not overdue:
            return 0
        nodes = {n.id: n for n in await self.store.nodes.all()}
        verdicts = await asyncio.gather(
            *(self.climb(task, silent_s, nodes) for task, silent_s in overdue)
        )
        await self._apply([move for _, move in verdicts if move is not None])
        return len(overdue)

    async def climb(
        self, task: Task, silent_s: float, nodes: dict[str, NodeRow]
    ) -> tuple[Rung, fsm.Move | None]:
        """One rung of the ladder for one overdue attempt; the move it decides (Lost, or the
        backend's outcome) is returned for the sweep to apply with the others in one go.
        `silent_s`: seconds since its lease was last renewed, by Postgres's clock."""
        timeout = task.heartbeat_timeout_s
        node = nodes.get(task.node or "")
        key = (task.id, task.attempt)
        overdue = silent_s - timeout
        rungs = self.rungs.setdefault(
            key, [f"lease not renewed for {silent_s:.1f} s (timeout {timeout:g} s)"]
        )
        answer: ProbeAnswer | Unreachable | None = UNREACHABLE
        move: fsm.Move | None = None
        if node is not None and node.ready and node.live:
            answer = await self.probe(task)
            if answer is UNREACHABLE:
                # its row still looks fresh, but no executor of it is connected: take it out
                # of placement now rather than when its row goes stale (it re-asserts itself
                # on its next heartbeat if it was only reconnecting)
                await self.store.nodes.set_ready(node.id, node.boot_id, False)
                log.warning("node %s has no executor connected: marked not ready", node.id)
        alive = answer is not UNREACHABLE
        said = answer.state if isinstance(answer, ProbeAnswer) else None
        if said == "finished" and isinstance(answer, ProbeAnswer) and answer.report is None:
            said = "unknown"  # "finished" without an outcome reconciles nothing
        if said == "frozen":
            rungs.append("backend: frozen by its watchdog")
            said = None  # as good as no answer: the node is alive but cannot renew
        rung = next_rung(Evidence(overdue, timeout, alive, said))
        if rung is Rung.GRACE:
            rungs.append(f"node {task.node} ready: grace to {2 * timeout:g} s")
            await self.store.leases.grace(task.id, task.attempt)
        elif rung is Rung.RESTORE:
            rungs.append("backend reports it running: deadline restored")
            log.warning("%s attempt %d: %s", task.id, task.attempt, "; ".join(rungs))
            await self.store.leases.restore(task.id, task.attempt)
            self.rungs.pop(key, None)
        elif rung is Rung.RECONCILE:
            assert isinstance(answer, ProbeAnswer)
            assert answer.report is not None
            rungs.append("backend reports it finished: reconciled to its outcome")
            move = end_move(task, answer.report, "; ".join(rungs))
        else:
            if not alive:
                rungs.append(f"node {task.node} gone (no executor connected, or not ready)")
            elif said is None:
                rungs.append("grace spent; backend: no answer")
            else:
                rungs.append(f"backend: attempt {said}")
            move = fsm.plan(task, State.LOST, "; ".join(rungs))
        if rung is not Rung.GRACE:
            self.rungs.pop(key, None)
        return rung, move

    async def _apply(self, moves: list[fsm.Move]) -> None:
        """The ladder's verdicts of one sweep, as one transaction (with the retries the
        reconciled failures earn); a lost CAS (the task moved on) is fine."""
        if not moves:
            return
        async with self.store.transaction() as tx:
            # a Lost whose lease was renewed meanwhile loses its CAS: the lease rules
            moved = await tx.tasks.transition_many(moves)
            await tx.tasks.transition_many(retries(moved))
        reasons = {m.task_id: m.reason for m in moves}
        for task in moved:
            log.warning(
                "%s attempt %d -> %s: %s",
                task.id,
                task.attempt,
                task.status.label,
                reasons[task.id],
                extra={"task_id": str(task.id), "attempt": task.attempt},
            )

    # -- asking the backend -------------------------------------------------------------------

    async def probe(self, task: Task) -> ProbeAnswer | Unreachable | None:
        """Ask the task's executor about the attempt: its answer; UNREACHABLE if no executor
        of that node is connected (the message comes straight back); None if it is connected
        but does not answer within SKED_PROBE_TIMEOUT_S."""
        if self._reply_queue is None or task.node is None:
            return UNREACHABLE
        correlation = uuid.uuid4().hex
        answer: asyncio.Future[ProbeAnswer] = asyncio.get_running_loop().create_future()
        self._answers[correlation] = answer
        body = heartbeat.Probe(task_id=task.id, attempt=task.attempt).model_dump_json().encode()
        try:
            exchange = await self.bus.channel.get_exchange(PROBE_EXCHANGE)
            sent = await exchange.publish(
                aio_pika.Message(
                    body,
                    content_type=JSON,
                    correlation_id=correlation,
                    reply_to=self._reply_queue.name,
                ),
                routing_key=task.node,
                mandatory=True,  # no executor bound for that node: returned at once
            )
            if isinstance(getattr(sent, "delivery", None), Basic.Return):
                return UNREACHABLE
            return await asyncio.wait_for(answer, self.settings.probe_timeout_s)
        except (TimeoutError, aio_pika.exceptions.AMQPError) as exc:
            log.info(
                "probe of %s on node %s: no answer (%s)", task.id, task.node, type(exc).__name__
            )
            return None
        finally:
            self._answers.pop(correlation, None)

    async def _on_answer(self, message: AbstractIncomingMessage) -> None:
        waiter = self._answers.get(message.correlation_id or "")
        if waiter is None or waiter.done():
            return
        try:
            waiter.set_result(ProbeAnswer.model_validate_json(message.body))
        except ValidationError as exc:  # an answer that cannot be read is no answer
            log.warning("unreadable probe answer ignored: %s", exc)


async def _close(channel: AbstractChannel) -> None:
    with contextlib.suppress(Exception):
        await channel.close()
