"""The executor: one process is one node. It claims dispatched attempts and starts them on its
backend (start.py), renews their leases and stops those taken away (watch.py), writes their
outcomes (finish.py), heartbeats as a node, and answers the heartbeat-monitor's probes.

start   dispatches from this node's queue (RabbitMQ prefetch = slots + SKED_PREFETCH, so it
        never hands this node more than it may hold); CAS Scheduling -> Running first, then
        the process; with a backlog, a dispatch beyond the free slots waits for one.
renew   every beat period, one statement renews the lease of every attempt here; each renewal
        Postgres confirms lets the node's watchdog run the attempt a lease longer. Without
        renewals (this process frozen, cut off, or Postgres away) the watchdog freezes the
        attempt on its own; a renewal thaws it; a refused one (the task moved on) kills it.
finish  outcomes in batches, in one transaction; then the dispatches are acknowledged.
nodes   serve the nodes the backend offers (one for a local executor, a cluster's Ready nodes
        for Kubernetes) and refresh their rows; a node silent for SKED_NODE_TTL_S gets no new
        work (services/executor/serving.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from pydantic import ValidationError

from services.executor.backends import Backend, Outcome
from services.executor.finish import Finisher, storable_report
from services.executor.node import Attempt, Node
from services.executor.serving import Serving, prefetch_count
from services.executor.start import Starter
from services.executor.watch import Watcher
from shared import heartbeat
from shared.bus import AmqpBus
from shared.errors import one_line
from shared.fsm import State
from shared.jsonvalue import clean_text, clip
from shared.queues import ReadyQueue
from shared.resilience import TRANSIENT
from shared.runtime import wait_any
from shared.service import Loop, Service
from shared.settings import Settings
from shared.store import TAKEN_CHANNEL, Handler, Store
from shared.store.notify import placed_channel

log = logging.getLogger(__name__)

REAPED = "its executor died; its processes were killed when the node's executor restarted"
SWEEP_EVERY = 30  # node heartbeats between sweeps for superseded attempts (detached backends)
REASSERT_EVERY = 5  # node heartbeats between declaring the nodes' queues again (serving.py)


class Executor(Service):
    def __init__(
        self, settings: Settings, store: Store, bus: AmqpBus, backend: Backend, queue: ReadyQueue
    ) -> None:
        super().__init__(settings, store)
        self.name = f"executor {settings.node_id}"
        self.settings = settings
        self.node = Node(settings, store, bus, backend, queue, self.stopping)
        self.starter = Starter(self.node)
        self.finisher = Finisher(self.node, self.starter)
        self.watcher = Watcher(self.node)
        self._channel: AbstractChannel | None = None
        self.serving: Serving | None = None

    def loops(self) -> Sequence[Loop]:
        # start and finish retry their Postgres writes until they land, so a batch is not
        # dropped by an outage; the supervisor covers the rest (a lost channel)
        loops: list[Loop] = [
            ("start", self.starter.run),
            ("finish", self.finisher.run),
            ("nodes", self._nodes_loop),
            ("watch", self.watcher.watch_loop),
            ("lease renewal", self.watcher.renew_loop),
        ]
        if self.settings.retention_days > 0:
            loops.append(("retention", self._retention_loop))
        return loops

    async def _retention_loop(self) -> None:
        """Retention on this node: what ended attempts left here (their log files) deleted
        once older than SKED_RETENTION_DAYS. A look reads the whole log directory (millions of
        files, at a month's retention and a few tasks a second), so it comes every
        SKED_RETENTION_CHECK_S or every thousandth of the retention, whichever is longer: a
        file outlives the retention by at most that much. (Recovery deletes the tasks' rows.)
        A failure is logged and tried again at the next look."""
        older_than_s = self.settings.retention_days * 86_400
        period = max(self.settings.retention_check_s, older_than_s / 1000)
        while not self.stopping.is_set():
            try:
                deleted = await self.node.backend.prune(older_than_s, set(self.node.active))
            except OSError:
                log.exception("retention: pruning this node's attempt logs failed")
            else:
                if deleted:
                    log.info("retention: deleted %d attempt logs", deleted)
            await wait_any(self.stopping, timeout=period)

    def watchers(self) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        # the node's warden gone means its attempts are gone: stop, loudly
        return [self.node.backend.watch]

    def channels(self) -> Sequence[tuple[str, Handler]]:
        taken = (TAKEN_CHANNEL, self.watcher.on_task_notify)
        if not self.node.gated:  # a cluster's executor takes dispatches by message only
            return [taken]
        return [taken, (placed_channel(self.node.id), self.node.placed)]

    def missed(self) -> None:
        self.node.suspect()

    async def setup(self) -> None:
        s, node = self.settings, self.node
        await node.backend.start()
        prefetch = prefetch_count(s.slots + node.backlog.limit)
        self._channel = channel = await node.bus.consumer_channel(prefetch=prefetch)
        probes = await channel.declare_queue(exclusive=True, auto_delete=True)
        await probes.consume(self._on_probe)
        self.serving = Serving(node, channel, probes)
        await self.serving.sync()
        # a cluster's Jobs run on while their executor restarts: follow ours again, and
        # delete those whose task moved on meanwhile (canceled, paused, lost and retried)
        await self.starter.adopt(set(await self.store.launches.by(node.id).mine()))
        await self.discard_superseded()
        await self.reaped_lost()

    async def reaped_lost(self) -> int:
        """The attempts a dead executor left on this node (a local backend's records, their
        processes killed by `backend.start`) are Lost at once, not a heartbeat timeout later:
        their processes are gone (and nothing of a dead executor's is left to fence: its
        shims end with it). Their leases are taken over first, as only the holder of an
        attempt's lease may call it lost (outcome.end_move). Returns how many."""
        node = self.node
        keys = sorted(set(node.backend.reaped) - set(node.active))
        if not keys:
            return 0
        sent_at = time.monotonic()
        # this node's only: the records lie where its tasks may write one naming any attempt
        adopted = await self.store.leases.adopt(node.boot_id, keys, node.id)
        for task in adopted:
            log.info("%s attempt %d: its executor died; lost", task.id, task.attempt)
            attempt = Attempt(task, None, sent_at)
            node.active[(task.id, task.attempt)] = attempt
            self.starter.ended(attempt, Outcome.gone(REAPED))
        return len(adopted)

    async def discard_superseded(self) -> int:
        """Stop what the backend runs for attempts no longer current (nobody follows them)."""
        node = self.node
        keys = node.backend.adoptable() - set(node.active)
        if not keys:
            return 0
        current = {t.id: t for t in await self.store.tasks.get_many(list({k[0] for k in keys}))}
        # only a task this database holds and that moved on: a Job of a task it does not know
        # may be another installation's in a shared namespace, and is left alone
        stale = {
            (task_id, attempt)
            for task_id, attempt in keys
            if (t := current.get(task_id)) is not None
            and not (t.status is State.RUNNING and t.attempt == attempt)
        }
        await node.backend.discard(stale)
        return len(stale)

    def announce(self) -> str:
        assert self.serving is not None
        served = self.serving.served.values()
        if self.node.backend.offers() is not None:
            return f"executor {self.node.id} ready: serving {len(served)} nodes"
        if not served:  # its queue refused (Serving._unusable said why): served once it mends
            return f"executor {self.node.id} up, not serving its node yet (see the warning)"
        o = next(iter(served)).offer
        return (
            f"executor {self.node.id} ready: {o.slots} slots, cpu {o.cpu:g}, memory "
            f"{o.memory_mb} MB, gpu {o.gpu}, labels {dict(o.labels)}"
        )

    async def draining(self) -> None:
        """Stop taking work, let what runs finish (bounded), then stop the rest. Until the
        drain is over the leases of what runs are renewed and attempts taken away stopped
        (node.drained ends the watcher's loops)."""
        node = self.node
        try:
            grace_s = self.settings.shutdown_grace_s
            until = time.monotonic() + grace_s
            if self.serving is not None:
                await self.serving.leave_all()
            # a claim in flight lands first: what it won is an attempt here (started before
            # the stop, or handed back as a launch failure: Starter._begin), not a stray one
            if not await wait_any(self.starter.quiet, timeout=grace_s):
                log.warning("the start loop did not end within %gs of the stop", grace_s)
            if node.backend.detached:
                # a cluster's Jobs run on without this executor: a restarted one (or another
                # replica, when their leases lapse) adopts them; a rollout kills no task
                await self._finish_what_ended()
                return
            await _runs_ended(node.runs, until)
            # at once, not one after another: each may wait out its SIGTERM -> SIGKILL grace
            running = list(node.backend.running())
            ends = [node.backend.stop_task(task_id, attempt) for task_id, attempt in running]
            for failed in await asyncio.gather(*ends, return_exceptions=True):
                if isinstance(failed, Exception):
                    log.error("stopping an attempt on shutdown failed: %s", one_line(failed))
            await _runs_ended(node.runs, time.monotonic() + 10)
        finally:
            node.outcomes.put_nowait(None)
            node.drained.set()

    async def _finish_what_ended(self) -> None:
        """Leave attempts that run on to be adopted; write the outcomes already known."""
        node = self.node
        await asyncio.sleep(0)  # let runs whose outcome just arrived queue it
        for run in list(node.runs):
            run.cancel()
        if node.runs:
            await asyncio.wait(node.runs, timeout=5)

    async def teardown(self) -> None:
        self.node.drained.set()  # (already, unless the service failed before its drain)
        if self._channel is not None:
            with contextlib.suppress(*TRANSIENT):
                await self._channel.close()
        self.watcher.close()
        await self.node.backend.close()

    def on_stop(self) -> None:
        self.node.inbox.put_nowait(None)

    async def _nodes_loop(self) -> None:
        """Each heartbeat period, or when the backend's nodes change: serve what it offers
        and refresh the rows of the nodes served. The first beat comes at once: a loop
        started again after a failed beat (a statement overran: db.pooled) has its rows a
        period and a statement's bound old already, against the node TTL."""
        node, serving = self.node, self.serving
        assert serving is not None
        beats = 0
        beat_at = time.monotonic()
        while not self.stopping.is_set():
            changed = node.backend.offers_changed
            timeout = max(beat_at - time.monotonic(), 0)
            await wait_any(
                self.stopping, changed, node.backlog_changed, node.taken, timeout=timeout
            )
            if self.stopping.is_set():
                return
            if node.taken.is_set() or time.monotonic() >= beat_at:
                # tasks may have been taken away while held here: those told of, or any
                among = None if time.monotonic() >= beat_at else node.taken_ids
                node.taken.clear()
                node.taken_ids = set()
                with contextlib.suppress(*TRANSIENT):  # else at the next heartbeat
                    await self.starter.drop_moved_on(among)
            if node.backlog_changed.is_set():
                node.backlog_changed.clear()
                with contextlib.suppress(*TRANSIENT):  # else the next heartbeat writes it
                    await serving.advertise()
            if not changed.is_set() and time.monotonic() < beat_at:
                continue
            beat_at = time.monotonic() + self.settings.node_heartbeat_s
            changed.clear()
            await serving.sync()
            beats += 1
            if node.backend.detached and beats % SWEEP_EVERY == 0:
                # Jobs whose executor was gone when their task moved on: nobody else stops them
                await self.discard_superseded()
            if not await serving.beat():
                log.error("node %s was taken over by another executor; stopping", node.id)
                self.stop()
                return
            if beats % REASSERT_EVERY == 0:  # after the beat: RabbitMQ may not answer
                await serving.reassert()

    async def _on_probe(self, message: AbstractIncomingMessage) -> None:
        """A monitor asks about one attempt whose lease lapsed: is it still running here, did
        it finish (and how), is it frozen, or does this node not know it? A probe this node
        cannot read is dead-lettered; nothing a probe holds can stop the executor."""
        node = self.node
        node.acks.received(message)  # first: it shares the dispatches' channel (node.Acks)
        try:
            probe = heartbeat.Probe.model_validate_json(message.body)
        except ValidationError as exc:
            with contextlib.suppress(*TRANSIENT):
                await node.dead_letter(message, f"unreadable probe: {exc}")
            return
        try:
            key = (probe.task_id, probe.attempt)
            cid = message.correlation_id  # the answer is signed for this probe (its MAC)
            if probe.want == "log":
                async with asyncio.timeout(self.settings.probe_timeout_s):
                    tail = await node.backend.log_tail(key, heartbeat.LIVE_LOG_CHARS)
                if tail is not None:  # cleaning lengthens a NUL: cut again, to the end
                    tail = clip(clean_text(tail), heartbeat.LIVE_LOG_CHARS, keep_end=True)
                known = key in node.backend.running()
                answer = heartbeat.answer(
                    node.secret, cid, probe, "running" if known else "unknown", log=tail
                )
            elif key in node.unreported:
                report = await storable_report(node.unreported[key])  # maybe in a thread
                answer = heartbeat.answer(node.secret, cid, probe, "finished", report=report)
            elif node.backend.frozen(key):
                answer = heartbeat.answer(node.secret, cid, probe, "frozen")
            elif key in node.backend.running():
                answer = heartbeat.answer(node.secret, cid, probe, "running")
            elif key in node.backend.adoptable() and await self.starter.adopt({key}):
                # its executor is gone, its Job runs on: this executor follows it from now
                answer = heartbeat.answer(node.secret, cid, probe, "running")
            else:
                answer = heartbeat.answer(node.secret, cid, probe, "unknown")
            if message.reply_to:
                await node.bus.reply(message, answer.model_dump_json().encode())
        except Exception:  # an answer that cannot be sent is no answer: the ladder copes
            log.exception("probe of %s attempt %d not answered", probe.task_id, probe.attempt)
        await node.acks.ack([message])


async def _runs_ended(runs: set[asyncio.Task[None]], until: float) -> None:
    """Wait until no attempt runs (runs begun meanwhile too), or until monotonic `until`."""
    while runs and (left := until - time.monotonic()) > 0:
        await asyncio.wait(set(runs), timeout=left)
