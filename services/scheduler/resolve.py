"""Workflow resolution: release or skip Pending workflow tasks when their upstreams finish
(shared.workflows decides under the tasks' row locks). Woken by the NOTIFY of a finish (or of
a resume to Pending); every SKED_RECONCILE_S, by the monotonic clock and however busy the
notifications keep it, it sweeps every Pending task that waits, a page at a time: the sweep is
what finds dependency timeouts, and the backstop for a decision a failed pass lost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from uuid import UUID

from services.scheduler.hub import Part
from shared import workflows
from shared.runtime import wait_any

SWEEP_PAGE = 10_000  # Pending tasks a sweep's statement reads and decides at once


class Resolver(Part):
    async def run(self, stopping: asyncio.Event) -> None:
        hub = self.hub
        period = self.settings.reconcile_s
        sweep_at = time.monotonic() + period
        while not stopping.is_set():
            hub.resolve.clear()
            if hub.resolve_all or time.monotonic() >= sweep_at:
                # on its own clock: notifications coming more often than the period (a busy
                # cluster) once kept the sweep, and so every dependency timeout, from coming
                hub.resolve_all = False
                sweep_at = time.monotonic() + period
                await self.sweep()
            else:
                named, hub.finished = hub.finished, set()
                candidates = [*await self.store.workflows.downstream_of(list(named)), *named]
                if await self._decide(candidates):
                    continue  # skips and releases may decide more downstream right away
            await wait_any(hub.resolve, stopping, timeout=max(sweep_at - time.monotonic(), 0))

    async def sweep(self) -> None:
        """Every Pending task with upstreams, decided a page at a time in id order: the first
        page alone, read again each time, would keep a task past it waiting for good."""
        after: UUID | None = None
        while True:
            page = await self.store.workflows.pending_with_deps(SWEEP_PAGE, after)
            await self._decide(page)
            if len(page) < SWEEP_PAGE:
                return
            after = page[-1]

    async def _decide(self, candidates: Sequence[UUID]) -> bool:
        """Release or skip what can be decided; whether anything was."""
        if not candidates:
            return False
        ready, skipped = await workflows.resolve(self.store, candidates)
        if ready:
            await self.queue.push(ready)
            self.hub.work_arrived()
        return bool(ready or skipped)
