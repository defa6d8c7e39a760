"""Reconciliation of the Redis queue with Postgres: rebuild it after a Redis loss (and at
start); re-queue Ready tasks it lost track of (a scheduler killed between its pop and its CAS);
move back resource waiters and fenced tasks whichever scheduler parked them. Every
SKED_RECONCILE_S; and every PRUNE_S, prune the parked sets and move the node-parked back."""

from __future__ import annotations

import asyncio
import random
import time

from services.scheduler.hub import Part
from shared.queues import FENCED_KEY, PARKED_KEY, RESOURCE_KEY, prune_parked, rebuild, reconcile
from shared.runtime import wait_any

PRUNE_S = 60.0  # the parked sets are pruned of tasks no longer Ready this often


class Reconciler(Part):
    async def rebuild(self) -> int:
        return await rebuild(self.queue, self.store.tasks)

    _pruned_at = -PRUNE_S  # monotonic

    async def reconcile_once(self) -> int:
        n = await reconcile(self.queue, self.store.tasks, self.settings.reconcile_s)
        if time.monotonic() - self._pruned_at >= PRUNE_S:
            await prune_parked(self.queue, self.store.tasks)
            # the backstop for tasks parked for want of a node: a node's notification is what
            # brings them back, and a park that raced one unseen would wait for the next
            n += await self.queue.unpark(PARKED_KEY)
            self._pruned_at = time.monotonic()
        # the backstop for resource waiters, whichever scheduler parked them (one that died
        # before a holder ended, or a pass that raced with another); and for fenced tasks,
        # whose leases run out with no notification
        n += await self.queue.unpark(RESOURCE_KEY)
        n += await self.queue.unpark(FENCED_KEY)
        if n:
            self.hub.dispatch.set()
        return n

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            jitter = random.uniform(0.8, 1.2)
            await wait_any(stopping, self.hub.rebuild, timeout=self.settings.reconcile_s * jitter)
            self.hub.rebuild.clear()
            if not stopping.is_set():
                await self.reconcile_once()
