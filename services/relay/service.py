"""The relay service: drains the outbox (shared.relay) at start, on every NOTIFY of a
transition (after a short linger, so that one pass carries many), and every SKED_RELAY_SWEEP_S.
Any number may run; they share the work by shard."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from shared.bus import AmqpBus
from shared.relay import OutboxRelay
from shared.resilience import backoff_s
from shared.runtime import wait_any
from shared.service import Service
from shared.settings import Settings
from shared.store import STARTED_CHANNEL, TASK_CHANNEL, Handler, Store

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # how long a cancelled pass may take to roll back once stop() came


class Relay(Service):
    name = "relay"

    def __init__(self, settings: Settings, store: Store, bus: AmqpBus) -> None:
        super().__init__(settings, store)
        self.outbox = OutboxRelay(
            store,
            bus,
            settings.relay_batch,
            vacuum_rows=settings.relay_vacuum_rows,
            confirm_timeout_s=settings.relay_confirm_timeout_s,
        )

    def channels(self) -> Sequence[tuple[str, Handler]]:
        # every event's outbox row: the starts told apart on a channel of their own too
        return [(TASK_CHANNEL, self._notified), (STARTED_CHANNEL, self._notified)]

    def announce(self) -> str:
        return f"relay listening on {TASK_CHANNEL} and {STARTED_CHANNEL}"

    @property
    def published(self) -> int:
        return self.outbox.published

    async def run_once(self) -> int:
        return await self.outbox.run_once()

    async def drain(self) -> int:
        return await self.outbox.drain()

    def _notified(self, *_: object) -> None:
        self.wake.set()

    async def loop(self) -> None:
        """Drain; while passes find events, the next is a linger away and nothing needs to wake
        this relay, so it stops listening (every notifying commit woke it and its backend: at
        100 tasks/s its CPU a task fell from ~565 to ~375 µs). A pass that finds none turns
        listening back on and looks once more — for what committed before LISTEN held — before
        it waits. A message the broker refused is tried again after a backoff, not on every
        NOTIFY: each try sends it again to every other subscriber."""
        listener = self.listener
        while not self.stopping.is_set():
            self.wake.clear()  # before draining: a NOTIFY during the drain means go again
            n = await self._drain_until_stopped()
            if n is None:
                return
            if self.outbox.refusals:
                await wait_any(self.stopping, timeout=backoff_s(self.outbox.refusals))
                continue
            if n:
                log.debug("relayed %d events", n)
                if listener is not None:
                    await listener.pause()
            elif listener is not None and not listener.wanted:
                await listener.resume()
                continue
            else:
                await wait_any(self.wake, self.stopping, timeout=self.settings.relay_sweep_s)
            # Linger a moment after a wake-up so that one pass carries the events of many
            # transitions: a pass per NOTIFY would cost Postgres a transaction per event.
            await wait_any(self.stopping, timeout=self.settings.relay_linger_s)

    async def _drain_until_stopped(self) -> int | None:
        """A drain, or None if stop() came first: the pass under way is cancelled, its
        transaction rolls back and its events stay in the outbox for the next relay (at worst
        sent again). A pass waiting on the broker would otherwise keep the service up for as
        long as its confirms take (CONFIRM_TIMEOUT_S, or a hung Postgres)."""
        draining = asyncio.ensure_future(self.drain())
        stopped = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({draining, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not draining.done():
                draining.cancel()
                # the rollback is a round trip; bounded, as every wait on a stop
                await asyncio.wait({draining}, timeout=STOP_GRACE_S)
        if not draining.done() or draining.cancelled():
            return None
        return draining.result()
