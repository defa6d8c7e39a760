"""Retention: finished tasks deleted once they ended longer ago than the retention (see
sql/retention.sql for what goes and why a workflow's tasks go only with their workflow), and
the operator API's audit rows once older than theirs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from shared.store.db import Db
from shared.store.queries import Q

# Workflows looked at a statement: those of them whose tasks fit the statement's bound go.
WORKFLOW_CANDIDATES = 20


@dataclass(frozen=True)
class Purged:
    tasks: int  # tasks deleted, a workflow's included
    workflows: int
    more: bool = False  # workflows past the retention may be left


class Retention:
    def __init__(self, db: Db) -> None:
        self.db = db

    async def purge_tasks(self, limit: int, older_than_s: float) -> list[UUID]:
        """Up to `limit` tasks outside any workflow that ended `older_than_s` ago or longer
        (Postgres time), deleted with their history. Returns their ids."""
        return [r["id"] for r in await self.db.fetch(Q.purge_tasks, limit, older_than_s)]

    async def purge_workflows(
        self, max_tasks: int, older_than_s: float, candidates: int = WORKFLOW_CANDIDATES
    ) -> Purged:
        """Workflows whose every task ended `older_than_s` ago or longer, oldest first,
        deleted whole, `max_tasks` tasks a statement at most: the oldest few that fit in one
        statement, or else the oldest alone, in chunks of `max_tasks` (`purge_oversize`). A
        statement of 20 workflows of 100,000 tasks ran for minutes, past any statement
        timeout, was rolled back, and was tried again on the same workflows for ever."""
        row = await self.db.fetchrow(Q.purge_workflows, max_tasks, older_than_s, candidates)
        assert row is not None  # one row of counts, always
        if row["oversize"] is None:
            return Purged(row["tasks"], row["workflows"], row["more"])
        tasks = await self.purge_oversize(row["oversize"], max_tasks, older_than_s)
        return Purged(tasks or 0, 0 if tasks is None else 1, more=True)

    async def purge_oversize(
        self, workflow_id: UUID, max_tasks: int, older_than_s: float
    ) -> int | None:
        """Workflow `workflow_id`, if every task of it still ended `older_than_s` ago or
        longer and no other replica is on it, deleted in one transaction of several
        statements, each of `max_tasks` tasks at most, and then its row. Readers see it whole
        until the commit, never half deleted; the workflow's lock keeps other replicas off it
        (they pass it over) and new tasks out of it. Returns the tasks deleted, or None when
        it was not deleted (gone already, or another replica holds it)."""
        deleted = 0
        async with self.db.atomic() as tx:
            members = await tx.fetchval(Q.lock_workflow_purge, workflow_id, older_than_s)
            if members is None:
                return None
            for start in range(0, len(members), max_tasks):
                chunk = members[start : start + max_tasks]
                deleted += await tx.fetchval(Q.purge_workflow_tasks, chunk)
            await tx.fetchval(Q.purge_workflow_row, workflow_id)
        return deleted

    async def purge_audit(self, limit: int, older_than_s: float) -> int:
        """Up to `limit` audit rows recorded `older_than_s` ago or longer (Postgres time),
        deleted. Returns how many."""
        return int(await self.db.fetchval(Q.purge_audit, limit, older_than_s))

    async def purge_tombstones(self, limit: int, older_than_s: float) -> int:
        """Up to `limit` tombstones of ids deleted `older_than_s` ago or longer, deleted.
        Returns how many."""
        return int(await self.db.fetchval(Q.purge_tombstones, limit, older_than_s))

    async def tasks_purged(self, ids: Sequence[UUID]) -> dict[UUID, datetime]:
        """Of these task ids, those retention deleted (and remembers) with no task of that id
        since, with when."""
        return {r["id"]: r["purged_at"] for r in await self.db.fetch(Q.tasks_purged, list(ids))}
