"""Claims: rows taken with FOR UPDATE SKIP LOCKED and moved through the FSM in the same
transaction, so that replicas share the work and never take the same task."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared import fsm
from shared.fsm import Move, State
from shared.models import Task
from shared.store.db import Db, task
from shared.store.queries import Q, Query
from shared.store.tasks import Tasks


class Claims:
    def __init__(self, db: Db) -> None:
        self.db = db

    async def _claim(self, query: Query, plan: Callable[[Task], Move], *args: Any) -> list[Task]:
        async with self.db.atomic() as db:
            rows = await db.fetch(query, *args)
            return await Tasks(db).transition_many([plan(task(r)) for r in rows])

    async def pick_runnable(self, limit: int, node: str | None = None) -> list[Task]:
        """Up to `limit` Ready tasks (highest priority, then oldest) into Scheduling, each with
        a new attempt number. (The scheduler places from its Redis queue; this is the plain
        Postgres way, kept for tools and tests.)"""
        changes: dict[str, Any] = {"node": node} if node is not None else {}
        return await self._claim(
            Q.claim_runnable, lambda t: fsm.plan(t, State.SCHEDULING, "picked", **changes), limit
        )

    async def sweep_due_retries(self, limit: int) -> list[Task]:
        """RetryWait tasks whose backoff has run out back to Ready."""
        return await self._claim(
            Q.claim_retry_due, lambda t: fsm.plan(t, State.READY, "backoff elapsed"), limit
        )

    async def recover_lost(self, limit: int, plan: Callable[[Task], Move]) -> list[Task]:
        """Lost tasks moved on as `plan` decides (retry, or fail)."""
        return await self._claim(Q.claim_lost, plan, limit)

    async def requeue_stuck_scheduling(self, limit: int, older_than_s: float) -> list[Task]:
        """Attempts dispatched but not started within `older_than_s`: back to Ready."""
        why = f"not started within {older_than_s:g} s"
        return await self._claim(
            Q.claim_stuck_scheduling, lambda t: fsm.plan(t, State.READY, why), limit, older_than_s
        )

    async def fail_unstarted(self, limit: int, plan: Callable[[Task], Move]) -> list[Task]:
        """Tasks waiting to start (Ready, Scheduling) past their schedule deadline, moved on
        as `plan` decides (Failed, final)."""
        return await self._claim(Q.claim_schedule_timed_out, plan, limit)
