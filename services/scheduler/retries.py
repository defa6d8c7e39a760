"""Retries: RetryWait tasks whose backoff ran out go back to Ready (SKIP LOCKED, shared by
replicas) and into the queue; the loop sleeps until the earliest is due — a wait Postgres
computes — or until a NOTIFY says a task entered RetryWait."""

from __future__ import annotations

import asyncio

from services.scheduler.hub import Part
from services.scheduler.timeouts import RECHECK_S
from shared.runtime import wait_any


class Retries(Part):
    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            self.hub.retry.clear()
            moved = await self.store.claims.sweep_due_retries(self.settings.dispatch_batch)
            if moved:
                await self.queue.push(moved)
                self.hub.work_arrived()
                continue
            # how long until the next is due, by Postgres's clock: a local clock that is off
            # would shift every retry by its error
            due_in = await self.store.tasks.next_retry_due()
            wait = self.settings.reconcile_s
            if due_in is not None:
                # one due already that the claim passed over is held by another transaction
                # (a replica's claim, a late result's FOR KEY SHARE, an operator's pause):
                # look again RECHECK_S later, not at once — that spun, 748 claims a second
                wait = min(wait, due_in if due_in > 0 else RECHECK_S)
            await wait_any(self.hub.retry, stopping, timeout=wait)
