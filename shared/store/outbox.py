"""The outbox: the events not yet published, a row each (table outbox, written with the event by
the statement that made the move). A relay locks the free shards, reads their oldest rows (each
event's JSON rendered by Postgres when it was written), publishes them and deletes them, in one
transaction: a crash before the commit leaves them for the next pass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple
from uuid import UUID

from shared.store.db import Db
from shared.store.queries import Q


class OutboxRow(NamedTuple):
    """A tuple, not a frozen dataclass: a relay reads one per event, and a frozen dataclass's
    __init__ (a setattr per field) was a tenth of the relay's CPU."""

    id: int  # the outbox row's; the event's own id is in its body
    task_id: UUID
    # A State's value as written: the relay only routes by it, and a state this release does
    # not know (a newer release's, during a rolling upgrade) must be relayed, not fail the pass.
    to_status: str
    body: str  # the event as JSON (models.Event's fields)


class Outbox:
    def __init__(self, db: Db) -> None:
        self.db = db

    async def lock_free_shards(self) -> list[int]:
        """Inside a transaction: the shards no other relay drains now, locked."""
        assert self.db.in_transaction, "shards are locked inside a transaction"
        return [r["shard"] for r in await self.db.fetch(Q.lock_free_shards)]

    async def unpublished(self, shards: Sequence[int], limit: int) -> list[OutboxRow]:
        rows = await self.db.fetch(Q.unpublished, list(shards), limit)
        return [OutboxRow(i, task_id, s, body) for i, task_id, s, body in rows]

    async def mark_published(self, ids: Sequence[int]) -> None:
        await self.db.execute(Q.mark_published, list(ids))

    async def may_vacuum(self) -> bool:
        return bool(await self.db.fetchval(Q.may_vacuum_outbox))

    async def vacuum(self) -> None:
        """VACUUM the outbox (sql/outbox.sql, vacuum_outbox): never inside a transaction."""
        assert not self.db.in_transaction, "VACUUM cannot run inside a transaction"
        await self.db.execute(Q.vacuum_outbox)
