"""The cluster-wide gauges' election and read (shared/metrics.py). Whichever process holds a
session-level advisory lock computes them; the lock lives on a pooled connection that this
process keeps out of the pool while it leads, and runs the reads on."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from shared.store.queries import Q


@dataclass(frozen=True)
class ClusterCounts:
    tasks: dict[str, int]  # tasks by state, for the states asked about
    outbox_backlog: int  # events not yet published
    relay_lag_s: float  # age of the oldest of them by Postgres's clock (0: none)


class ClusterGauges:
    def __init__(self, pool: asyncpg.Pool, timeout_s: float = 10.0) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self._conn: asyncpg.Connection | None = None

    @property
    def leading(self) -> bool:
        return self._conn is not None

    async def lead(self) -> bool:
        """Whether this process computes the gauges: it already holds the lock, or takes it
        now (without waiting)."""
        if self._conn is not None:
            return True
        conn = await self.pool.acquire(timeout=self.timeout_s)
        try:
            got = bool(await conn.fetchval(Q.lead_gauges.sql, timeout=self.timeout_s))
        except BaseException:
            # the server may have granted the lock before the answer was lost (a timeout): a
            # connection back in the pool would hold it for good, and no process would lead
            conn.terminate()
            await self.pool.release(conn)
            raise
        if got:
            self._conn = conn
        else:
            await self.pool.release(conn)
        return got

    async def read(self, states: Sequence[str]) -> ClusterCounts:
        """The gauges, on the lock's own connection: if it broke, the lock is gone too, and
        this raises (the caller resigns)."""
        assert self._conn is not None, "only the leader reads the cluster-wide gauges"
        row = await self._conn.fetchrow(Q.cluster_gauges.sql, list(states), timeout=self.timeout_s)
        assert row is not None
        counts = dict(zip(row["states"], row["counts"], strict=True))
        return ClusterCounts(
            {s: int(counts.get(s, 0)) for s in states},
            int(row["outbox_backlog"]),
            float(row["relay_lag_s"]),
        )

    async def resign(self) -> None:
        """Give the lock up, and the connection back to the pool (pooled connections are not
        reset on release: shared/store/db.py)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            await conn.execute(Q.resign_gauges.sql, timeout=self.timeout_s)
        except Exception:
            # broken (asyncpg has given it back to the pool already), or it cannot unlock:
            # either way its session ends, and the lock with it
            with contextlib.suppress(Exception):
                conn.terminate()
        finally:
            await self.pool.release(conn)
