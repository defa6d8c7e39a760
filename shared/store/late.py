"""Late results: outcomes of attempts that no longer owned their task, kept, never applied."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

from shared.store.db import Db
from shared.store.queries import Q


class LateResults:
    def __init__(self, db: Db) -> None:
        self.db = db

    async def record(self, results: Sequence[tuple[UUID, int, bool, Any, str | None, str]]) -> None:
        """(task id, attempt, ok, result, error, note) rows; an attempt recorded already is
        skipped (one attempt, one outcome: a retried write records nothing twice)."""
        if results:
            await self.db.execute(
                Q.record_late_results, *(list(x) for x in zip(*results, strict=True))
            )
