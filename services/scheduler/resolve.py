"""Workflow resolution: release or skip Pending workflow tasks when their upstreams finish
(shared.workflows decides under the tasks' row locks). Woken by the NOTIFY of a finish (or of
a resume to Pending); every SKED_RECONCILE_S it sweeps every Pending task that waits."""

from __future__ import annotations

import asyncio

from services.scheduler.hub import Part
from shared import workflows
from shared.runtime import wait_any


class Resolver(Part):
    async def run(self, stopping: asyncio.Event) -> None:
        hub = self.hub
        while not stopping.is_set():
            hub.resolve.clear()
            if hub.resolve_all:
                hub.resolve_all = False
                candidates = await self.store.workflows.pending_with_deps(10_000)
            else:
                named, hub.finished = hub.finished, set()
                candidates = [*await self.store.workflows.downstream_of(list(named)), *named]
            if candidates:
                ready, skipped = await workflows.resolve(self.store, candidates)
                if ready:
                    await self.queue.push(ready)
                    hub.work_arrived()
                if ready or skipped:
                    continue  # skips and releases may decide more downstream right away
            if not await wait_any(hub.resolve, stopping, timeout=self.settings.reconcile_s):
                hub.resolve_all = True
