"""The heartbeat-monitor's own statements on Postgres (shared/store/sql/monitor.sql): when
deadlines restart after an outage, and the clock its sweep loop sleeps by."""

from __future__ import annotations

from shared.store.db import Db
from shared.store.queries import Q


class MonitorDeadlines:
    def __init__(self, db: Db) -> None:
        self.db = db

    async def restart_at_boot(self) -> int:
        """Give every Running attempt a heartbeat timeout from Postgres's start before it is
        judged (nothing to do once Postgres has been up that long); returns how many moved."""
        status = await self.db.execute(Q.restart_deadlines_at_boot, self.db.lease_margin_s)
        return int(status.split()[-1])

    async def restart_after_outage(self, since: float) -> int:
        """Give the Running attempts whose lease lapsed since `since` (Postgres's epoch
        seconds) a heartbeat timeout from now; returns how many moved."""
        status = await self.db.execute(
            Q.restart_deadlines_after_outage, since, self.db.lease_margin_s
        )
        return int(status.split()[-1])

    async def clock(self) -> tuple[float | None, float, float]:
        """(Seconds until the earliest deadline, or None; when Postgres started; Postgres's
        now), epoch seconds."""
        row = await self.db.fetchrow(Q.sweep_clock)
        assert row is not None
        return row["wait_s"], row["started"], row["now"]
