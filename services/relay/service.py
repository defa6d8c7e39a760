"""The relay service: drains the outbox (shared.relay) at start, on every NOTIFY of a
transition (after a short linger, so one pass carries many), and every SKED_RELAY_SWEEP_S."""

from __future__ import annotations

import asyncio
import logging

from shared.bus import AmqpBus
from shared.relay import OutboxRelay
from shared.resilience import supervise
from shared.runtime import wait_any
from shared.settings import Settings
from shared.store import TASK_CHANNEL, Store

log = logging.getLogger(__name__)


class Relay:
    """Publishes the outbox. Any number may run at once; they share work by shard."""

    def __init__(self, settings: Settings, store: Store, bus: AmqpBus) -> None:
        self.settings = settings
        self.store = store
        self.outbox = OutboxRelay(store, bus, settings.relay_batch)
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()

    @property
    def published(self) -> int:
        return self.outbox.published

    async def run_once(self) -> int:
        return await self.outbox.run_once()

    async def drain(self) -> int:
        return await self.outbox.drain()

    def _notified(self, *_: object) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Drain at start (nothing stranded), then on every NOTIFY and every sweep period."""
        listener = self.store.listener([(TASK_CHANNEL, self._notified)], self._wake.set)
        async with asyncio.TaskGroup() as group:
            group.create_task(listener.run(self._stopping))
            group.create_task(supervise("relay", self._loop, self._stopping))
            await asyncio.wait_for(listener.connected.wait(), None)
            log.info("relay listening on %s", TASK_CHANNEL)

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()  # before draining: a NOTIFY during the drain means go again
            n = await self.drain()
            if n:
                log.debug("relayed %d events", n)
            await wait_any(self._wake, self._stopping, timeout=self.settings.relay_sweep_s)
            # Linger a moment after a wake-up so that one pass carries the events of many
            # transitions: a pass per NOTIFY would cost Postgres a transaction per event.
            await wait_any(self._stopping, timeout=self.settings.relay_linger_s)

    def stop(self) -> None:
        self._stopping.set()
