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


@dataclass(frozen=True)
class Purged:
    tasks: int  # tasks deleted, a workflow's included
    workflows: int


class Retention:
    def __init__(self, db: Db) -> None:
        self.db = db

    async def purge_tasks(self, limit: int, older_than_s: float) -> list[UUID]:
        """Up to `limit` tasks outside any workflow that ended `older_than_s` ago or longer
        (Postgres time), deleted with their history. Returns their ids."""
        return [r["id"] for r in await self.db.fetch(Q.purge_tasks, limit, older_than_s)]

    async def purge_workflows(self, limit: int, older_than_s: float) -> Purged:
        """Up to `limit` workflows whose every task ended `older_than_s` ago or longer,
        deleted whole."""
        row = await self.db.fetchrow(Q.purge_workflows, limit, older_than_s)
        assert row is not None  # one row of counts, always
        return Purged(row["tasks"], row["workflows"])

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
