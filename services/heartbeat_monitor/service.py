"""The heartbeat-monitor: takes heartbeats, and confirms a loss before anything is marked Lost.

take     beats from task processes (HTTP `POST /heartbeat`, bearer token per attempt) and from
         anyone over RabbitMQ (`sked.heartbeats`); coalesced in memory per attempt and written
         every SKED_HEARTBEAT_FLUSH_S in one statement, fenced by attempt and sequence (beats.py).
sweep    the deadline index (`tasks.hb_deadline`, partial on Running) gives the attempts whose
         lease ran out, leased with SKIP LOCKED so replicas share them; the loop sleeps until
         the earliest deadline (at most a second, a wait Postgres computes). No attempt is judged
         before a timeout since Postgres started: time executors could not renew is not held
         against them.
ladder   ask the executor (its answer signed for the probe, or none): running with a live
         lease -> restore; finished -> reconcile to the real outcome; frozen, running without
         a lease, or no answer from a ready node -> grace to 2x the timeout; else Lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import asyncpg
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from aiohttp import web
from pydantic import ValidationError

from services.heartbeat_monitor.beats import Beats
from services.heartbeat_monitor.http import make_app, runner
from services.heartbeat_monitor.ladder import Ladder
from shared.bus import HEARTBEATS_QUEUE, AmqpBus
from shared.heartbeat import BeatMessage, token_ok
from shared.resilience import TRANSIENT
from shared.runtime import wait_any
from shared.service import Loop, Service
from shared.settings import Settings
from shared.store import Store
from shared.throttle import Throttled

log = logging.getLogger(__name__)

# What the sweep loop fails on when Postgres is away or cut off (RabbitMQ's are a probe's
# "no answer", inside the ladder)
POSTGRES_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)
# A sweep whose reads took this long met Postgres stalled (a lock held on tasks, a slow link):
# the executors' renewals stalled with it, so its verdicts are not applied, and what lapsed
# meanwhile is made up for as after an outage (each lease once at most).
STALL_S = 1.0


class Stalled(Exception):
    pass


class HeartbeatMonitor(Service):
    name = "heartbeat-monitor"

    def __init__(self, settings: Settings, store: Store, bus: AmqpBus) -> None:
        super().__init__(settings, store)
        self.secret = settings.require_heartbeat_secret()
        self.bus = bus
        self.beats = Beats(store)
        self.ladder = Ladder(store, bus, settings.probe_timeout_s, self.secret)
        # Tx.monitor once shared/store/store.py builds it; until then on the store's pool
        self.deadlines = store.monitor
        # Postgres's clock: when this monitor last reached it, and when it started; and the
        # start of an outage the sweep loop has not yet made up for
        self._postgres_seen: float | None = None
        self._postgres_started: float | None = None
        self._outage_since: float | None = None
        self._just_stalled = False  # the last sweep met a stall (STALL_S)
        self.port = settings.monitor_port
        self._wake_sweep = asyncio.Event()
        self._channel: AbstractChannel | None = None
        self._runner: web.AppRunner | None = None
        # whoever may publish to `sked.heartbeats` could otherwise flood the log
        self._unreadable, self._forged = Throttled(log), Throttled(log)

    def loops(self) -> Sequence[Loop]:
        return [("heartbeat flush", self._flush_loop), ("deadline sweep", self._sweep_loop)]

    async def setup(self) -> None:
        self._channel = await self.bus.consumer_channel(prefetch=1000)
        beats = await self._channel.get_queue(HEARTBEATS_QUEUE)
        await beats.consume(self._on_beats)
        self._runner = runner(make_app(self.beats, self.secret))
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.monitor_host, self.settings.monitor_port)
        await site.start()
        if self._runner.addresses:  # the port actually bound, when 0 asked for any free one
            self.port = self._runner.addresses[0][1]

    def announce(self) -> str:
        host = self.settings.monitor_host
        return f"heartbeat-monitor listening on http://{host}:{self.port}/heartbeat"

    async def teardown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()

    async def _on_beats(self, message: AbstractIncomingMessage) -> None:
        """Beats over RabbitMQ. A message that is not a valid BeatMessage (bad JSON, a field
        out of range, unknown fields) is dead-lettered with the reason; a beat whose token is
        not its attempt's is refused alone (counted, logged at most every few seconds), the
        message's other beats taken; nothing stops this."""
        try:
            body = BeatMessage.model_validate_json(message.body)
        except ValidationError as exc:
            self.beats.refused()
            self._unreadable.warning("dead-lettering a heartbeat message: %s", exc)
            with contextlib.suppress(*TRANSIENT):
                await self.bus.dead_letter(
                    message.body, f"unreadable heartbeat message: {exc}", message.routing_key or ""
                )
        else:
            signed = [b for b in body.beats if token_ok(self.secret, b.task_id, b.attempt, b.token)]
            if forged := len(body.beats) - len(signed):
                self.beats.refused(forged)
                self._forged.warning(
                    "%d heartbeat(s) over RabbitMQ from node %r refused: bad token",
                    forged,
                    body.node.id,
                )
            self.beats.take(signed)
        with contextlib.suppress(*TRANSIENT):
            await message.ack()

    async def _flush_loop(self) -> None:
        while not self.stopping.is_set():
            await wait_any(self.stopping, timeout=self.settings.heartbeat_flush_s)
            await self.beats.flush()

    async def _sweep_loop(self) -> None:
        """Sweep overdue attempts, sleeping until the earliest deadline (at most a second).

        Time executors could not renew is not held against them. No attempt is judged before
        a heartbeat timeout since Postgres started (`restart_at_boot`: at this loop's start,
        and when Postgres's start time changed) — anchored to Postgres's start, not this
        monitor's, so a monitor that restarts moves nothing. And after this loop failed on
        Postgres, the attempts whose lease lapsed while it could not reach it get a timeout
        from then (`restart_after_outage`): an outage of everyone's that Postgres survived
        without a restart; each lease once at most. A failure on anything else moves no
        deadline. Nor does a stall (STALL_S): Postgres answering late is an outage too."""
        restart = True
        while not self.stopping.is_set():
            try:
                if restart:
                    await self._restart_deadlines()
                    restart = False
                handled = await self.sweep_once()
                asked = time.monotonic()
                wait_s, started, now = await self.deadlines.clock()
                self._stalled(time.monotonic() - asked, "clock")  # the next sweep is first
            except Stalled as exc:
                log.warning("%s: no attempt judged, and lapsed leases get a timeout anew", exc)
                self._outage_since, restart = self._postgres_seen, True
                self._just_stalled = True
                continue
            except POSTGRES_ERRORS:
                self._outage_since = self._postgres_seen
                raise
            self._postgres_seen, self._just_stalled = now, False
            if self._postgres_started is not None and started != self._postgres_started:
                restart = True
            self._postgres_started = started
            if handled or restart:
                continue
            wait = 1.0 if wait_s is None else min(1.0, max(wait_s, 0.01))
            await wait_any(self._wake_sweep, self.stopping, timeout=wait)
            self._wake_sweep.clear()

    async def _restart_deadlines(self) -> None:
        n = await self.deadlines.restart_at_boot()
        if n:
            log.info("Postgres started lately: %d Running attempt(s) get a timeout from then", n)
        if self._outage_since is not None:
            n = await self.deadlines.restart_after_outage(self._outage_since)
            self._outage_since = None
            if n:
                log.info("after losing Postgres: %d Running attempt(s) get a timeout anew", n)

    async def sweep_once(self) -> int:
        began = time.monotonic()
        # beats that arrived up to now count before anything is judged overdue
        await self.beats.flush()
        lease = self.settings.probe_timeout_s + 5.0
        overdue = await self.store.leases.overdue(100, lease)
        # (even with nothing read: it was judged by Postgres's now() as the statement began,
        # before the stall, and the next sweep must not find what lapsed in it overdue)
        self._stalled(time.monotonic() - began, "sweep")
        return await self.ladder.sweep(overdue)

    def _stalled(self, took: float, what: str) -> None:
        """Raise Stalled if Postgres kept this loop's `what` waiting past STALL_S: once, not
        twice running (Postgres slow for good would then put every verdict off for ever)."""
        if took > STALL_S and self._postgres_seen is not None and not self._just_stalled:
            raise Stalled(f"Postgres stalled the {what} for {took:.1f} s")
