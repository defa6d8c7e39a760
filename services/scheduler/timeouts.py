"""Schedule timeouts: a task that waited in Ready or Scheduling past its schedule deadline
(TaskSpec.schedule_timeout_s, counted from when it last entered Ready from a waiting state)
ends Failed, final. Overdue tasks are claimed FOR UPDATE SKIP LOCKED (replicas share them) and
moved through the FSM's CAS, so an executor's start claim racing the move either wins (the
task runs) or loses (nothing starts after Failed). The loop sleeps until the earliest deadline
— a wait Postgres computes — or until a NOTIFY says a task entered Ready (its deadline may be
the earliest now), with SKED_RECONCILE_S as the backstop."""

from __future__ import annotations

import asyncio
import logging

from services.scheduler.hub import Part
from shared.models import Task
from shared.outcome import not_started
from shared.runtime import wait_any

log = logging.getLogger(__name__)

# Overdue tasks (or due retries: services/scheduler/retries.py) that could not be claimed
# (another replica, or a start claim, holds them): look again this soon rather than spin on
# them.
RECHECK_S = 0.05


class ScheduleTimeouts(Part):
    async def run(self, stopping: asyncio.Event) -> None:
        hub = self.hub
        while not stopping.is_set():
            hub.deadlines.clear()
            # one index probe per wake-up; the claim (a transaction) only when one is due
            due_in = await self.store.tasks.next_schedule_deadline()
            if due_in is not None and due_in <= 0 and await self.fail_overdue():
                continue  # more may be due already: look again at once
            wait = self.settings.reconcile_s
            if due_in is not None:
                wait = min(wait, max(due_in, RECHECK_S))
            await wait_any(hub.deadlines, stopping, timeout=wait)

    async def fail_overdue(self) -> list[Task]:
        """One batch of overdue tasks -> Failed; their leftover queue entries are dropped (a
        popped one would be dropped by dispatch anyway: it is no longer Ready)."""
        failed = await self.store.claims.fail_unstarted(self.settings.dispatch_batch, not_started)
        if failed:
            await self.queue.remove([t.id for t in failed])
            log.info(
                "%d task(s) not started within their schedule timeout: failed (%s%s)",
                len(failed),
                ", ".join(str(t.id) for t in failed[:5]),
                ", ..." if len(failed) > 5 else "",
            )
        return failed
