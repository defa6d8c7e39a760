"""Leases and heartbeats: renewals from executors, beats from anyone, and the reads of the
heartbeat-monitor's sweep (shared/lease.py has the timing; docs/architecture.md the argument)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from uuid import UUID

import asyncpg

from shared.models import Task
from shared.store.db import Db, connect, task
from shared.store.queries import Q


def _columns(pairs: Sequence[tuple[UUID, int]]) -> tuple[list[UUID], list[int]]:
    ids, numbers = zip(*pairs, strict=True)
    return list(ids), list(numbers)


class Leases:
    def __init__(self, db: Db) -> None:
        self.db = db

    async def renew(
        self, owner: UUID, attempts: Sequence[tuple[UUID, int]]
    ) -> set[tuple[UUID, int]]:
        """Renew the leases `owner` holds on these (task, attempt)s; returns those renewed."""
        return (await self.renewal(owner, attempts))[0]

    async def renewal(
        self, owner: UUID, attempts: Sequence[tuple[UUID, int]]
    ) -> tuple[set[tuple[UUID, int]], set[tuple[UUID, int]]]:
        """Renew the leases `owner` holds on these (task, attempt)s without waiting for a row
        another transaction holds. Returns (those renewed, those passed over: still held by
        `owner`, not renewed this time); the rest are refused."""
        if not attempts:
            return set(), set()
        rows = await self.db.fetch(
            Q.renew_leases, owner, *_columns(attempts), self.db.lease_margin_s
        )
        renewed = {(r["id"], r["attempt"]) for r in rows if r["renewed"]}
        return renewed, {(r["id"], r["attempt"]) for r in rows if not r["renewed"]}

    async def adopt(
        self, owner: UUID, attempts: Sequence[tuple[UUID, int]], node: str | None = None
    ) -> list[Task]:
        """Take over the leases of these attempts while they are Running (their objects run on
        without the executor that started them), only those placed on `node` if one is
        named; returns the tasks adopted."""
        if not attempts:
            return []
        rows = await self.db.fetch(
            Q.adopt_leases, owner, *_columns(attempts), self.db.lease_margin_s, node
        )
        return [task(r) for r in rows]

    async def release(self, owner: UUID, attempts: Sequence[tuple[UUID, int]]) -> None:
        """Give up the leases of attempts `owner` no longer runs (their processes are gone)."""
        if attempts:
            await self.db.execute(Q.release_leases, owner, *_columns(attempts))

    async def apply_heartbeats(
        self, beats: Sequence[tuple[UUID, int, int]]
    ) -> set[tuple[UUID, int]]:
        """Apply (task id, attempt, seq) heartbeats; returns the (task, attempt) applied."""
        if not beats:
            return set()
        ids, attempts, seqs = (list(x) for x in zip(*beats, strict=True))
        rows = await self.db.fetch(Q.apply_heartbeats, ids, attempts, seqs)
        return {(r["id"], r["attempt"]) for r in rows}

    async def overdue(self, limit: int, lease_s: float) -> list[tuple[Task, float]]:
        """Overdue Running attempts, leased to the caller for `lease_s`, each with the seconds
        since its lease was last renewed."""
        rows = await self.db.fetch(Q.lease_overdue, limit, lease_s)
        return [(task(row), float(row["_silent_s"] or 0.0)) for row in rows]

    async def grace(self, task_id: UUID, attempt: int) -> None:
        await self.db.execute(Q.grace_deadline, task_id, attempt)

    async def restore(self, task_id: UUID, attempt: int) -> None:
        await self.db.execute(Q.restore_deadline, task_id, attempt, self.db.lease_margin_s)

    async def restart_deadlines(self) -> int:
        """Give every Running attempt a heartbeat timeout from now before it is judged."""
        status = await self.db.execute(Q.restart_deadlines, self.db.lease_margin_s)
        return int(status.split()[-1])

    async def next_deadline(self) -> tuple[float | None, float]:
        """(Seconds until the earliest deadline, or None; when Postgres started, epoch s)."""
        row = await self.db.fetchrow(Q.next_deadline)
        assert row is not None
        return row["wait_s"], row["started"]


class LeaseLink:
    """An executor's renewals, on a connection of their own. A renewal that takes longer than
    its timeout drops the connection: a partition that swallows packets must not leave one
    hanging while the watchdog's clock runs; the next renewal connects afresh."""

    def __init__(self, dsn: str, lease_margin_s: float) -> None:
        self.dsn = dsn
        self.lease_margin_s = lease_margin_s
        self._conn: asyncpg.Connection | None = None

    async def renew(
        self,
        owner: UUID,
        attempts: Sequence[tuple[UUID, int]],
        timeout: float,
        connecting: float | None = None,
    ) -> tuple[set[tuple[UUID, int]], set[tuple[UUID, int]]]:
        """Leases.renewal on this link: (renewed, passed over). Bounded by `timeout` (the
        period) or, if longer, by `connecting` (what is left of the shortest lease) when it
        connects afresh and by half of that on a connection made before: a link slower than
        the period (a round trip of 2.4 s against a 2 s period) must not fail every renewal
        and drop its connection, and one gone silent (a NAT that dropped its state) must be
        given up while a fresh connection still fits in the lease."""
        if not attempts:
            return set(), set()
        fresh = self._conn is None or self._conn.is_closed()
        left = (connecting or 0) if fresh else (connecting or 0) / 2
        try:
            async with asyncio.timeout(max(timeout, left)):
                if self._conn is None or self._conn.is_closed():
                    self._conn = await connect(self.dsn)
                db = Db(self._conn, self.lease_margin_s)
                return await Leases(db).renewal(owner, attempts)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None
