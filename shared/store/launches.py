"""Launches: the object each attempt of a cluster backend runs as (a Kubernetes Job's uid),
recorded once it exists — never created twice, adopted only by its uid, found again after the
executor that launched it restarts."""

from __future__ import annotations

from uuid import UUID

from shared.store.db import Db
from shared.store.queries import Q


class Launches:
    def __init__(self, db: Db, executor: str = "") -> None:
        self.db = db
        self.executor = executor  # who records (an executor's node id)

    def by(self, executor: str) -> Launches:
        """This store's launches as recorded by `executor`."""
        return Launches(self.db, executor)

    async def record(self, task_id: UUID, attempt: int, name: str, uid: str) -> None:
        await self.db.execute(Q.record_launch, task_id, attempt, name, uid, self.executor)

    async def recorded(self, task_id: UUID, attempt: int) -> str | None:
        uid: str | None = await self.db.fetchval(Q.launch_uid, task_id, attempt)
        return uid

    async def mine(self) -> list[tuple[UUID, int]]:
        """The attempts this executor launched that are still Running."""
        rows = await self.db.fetch(Q.launched_by, self.executor)
        return [(r["task_id"], r["attempt"]) for r in rows]
