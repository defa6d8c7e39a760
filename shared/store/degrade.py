"""The degrade mode row every scheduler obeys, and what the automatic triggers read."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any
from uuid import UUID

from shared.degrade import DegradeState, Mode, Snapshot
from shared.store.db import Db
from shared.store.queries import Q

DEGRADE_CHANNEL = "sked_degrade"  # NOTIFY when the mode changes


def _state(row: Mapping[str, Any]) -> DegradeState:
    return DegradeState(
        mode=Mode(row["mode"]),
        automatic=row["automatic"],
        reason=row["reason"],
        set_by=row["set_by"],
        since=row["since"],
        until=row["until"],
        version=row["version"],
        remaining_s=row["remaining_s"],
        calm_s=row["calm_s"],
    )


class Degrade:
    def __init__(self, db: Db) -> None:
        self.db = db

    async def read(self) -> DegradeState:
        row = await self.db.fetchrow(Q.read_degrade)
        assert row is not None, "migration 0012 inserts the one degrade row"
        return _state(row)

    async def set(
        self,
        mode: Mode,
        reason: str,
        set_by: str,
        for_s: float | None,
        version: int,
        automatic: bool = False,
    ) -> DegradeState | None:
        """CAS the mode (None: it changed since `version` was read)."""
        row = await self.db.fetchrow(
            Q.set_degrade, mode.value, automatic, reason, set_by, for_s, version
        )
        return None if row is None else _state(row)

    async def mark_calm(self, calm: bool, version: int) -> None:
        """Record that an automatic mode's cause is gone (from now, unless already) or holds."""
        await self.db.execute(Q.mark_calm, calm, version)

    async def lead(self) -> bool:
        """Inside a transaction: whether this scheduler evaluates the triggers now."""
        assert self.db.in_transaction, "the evaluator's lock lasts one transaction"
        return bool(await self.db.fetchval(Q.lead_degrade))

    async def snapshot(
        self, healthy_within_s: float, seen_within_s: float, lost: Collection[str] = ()
    ) -> Snapshot:
        """What the triggers look at; of the nodes `lost`, which came back or departed."""
        row = await self.db.fetchrow(
            Q.degrade_snapshot, healthy_within_s, seen_within_s, sorted(lost)
        )
        assert row is not None
        return Snapshot(**{k: row[k] for k in row.keys()})  # noqa: SIM118 - a Record

    async def ready_at_least(
        self, priority: int, limit: int, after: tuple[int, datetime, UUID] | None = None
    ) -> list[tuple[int, datetime, UUID]]:
        """Ready tasks at or above `priority` as (priority, queued_at, id), highest first, at
        most `limit`; after `after` in that order when given."""
        rows = await self.db.fetch(Q.ready_at_least, priority, limit, *(after or (None,) * 3))
        return [(r["priority"], r["queued_at"], r["id"]) for r in rows]
