"""The unit of work over every aggregate (`Tx`), and sked's Postgres (`Store`): import them
from `shared.store`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import asyncpg

from shared import hooks
from shared.store.claims import Claims
from shared.store.db import COMMAND_S, Db, create_pool, pinned_dsn, pooled
from shared.store.degrade import Degrade
from shared.store.gauges import ClusterGauges
from shared.store.late import LateResults
from shared.store.launches import Launches
from shared.store.leases import LeaseLink, Leases
from shared.store.monitor import MonitorDeadlines
from shared.store.nodes import Nodes
from shared.store.notify import Handler, PgListener
from shared.store.outbox import Outbox
from shared.store.retention import Retention
from shared.store.tasks import Tasks
from shared.store.tokens import Tokens
from shared.store.workflows import Workflows


class Tx:
    """The aggregates, all on one database target (a pool, or a transaction's connection)."""

    def __init__(self, db: Db, node_ttl_s: float) -> None:
        self.tasks = Tasks(db)
        self.claims = Claims(db)
        self.leases = Leases(db)
        self.workflows = Workflows(db)
        self.nodes = Nodes(db, node_ttl_s)
        self.outbox = Outbox(db)
        self.late = LateResults(db)
        self.launches = Launches(db)
        self.degrade = Degrade(db)
        self.tokens = Tokens(db)
        self.retention = Retention(db)
        self.monitor = MonitorDeadlines(db)


class Store(Tx):
    """sked's Postgres. `lease_margin_s`: how long past an attempt's lease its task may be
    declared Lost or start again; `node_ttl_s`: a node silent this long is not live."""

    def __init__(
        self, pool: asyncpg.Pool, dsn: str, lease_margin_s: float = 0.5, node_ttl_s: float = 10.0
    ) -> None:
        super().__init__(Db(pool, lease_margin_s), node_ttl_s)
        self.pool = pool
        self.dsn = dsn
        self.lease_margin_s = lease_margin_s
        self.node_ttl_s = node_ttl_s

    @classmethod
    async def connect(
        cls,
        dsn: str,
        size: int = 8,
        lease_margin_s: float = 0.5,
        node_ttl_s: float = 10.0,
        idle_in_tx_s: float | None = None,
        statement_s: float = COMMAND_S,
    ) -> Store:
        """The store on a pool of `size` (its sessions' bound on a transaction left idle, and
        its bound on a statement: db.create_pool); its LISTEN and lease connections, opened
        later on its `dsn`, work in the same schema as the pool (db.pinned_dsn)."""
        dsn = pinned_dsn(dsn)
        pool = await create_pool(dsn, size, idle_in_tx_s, statement_s)
        return cls(pool, dsn, lease_margin_s, node_ttl_s)

    async def close(self) -> None:
        await self.pool.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        """One transaction: everything done through the Tx commits together, or not at all;
        and the moves it made are told to the hooks (metrics, traces) only once it commits."""
        with hooks.told_on_commit():
            async with pooled(self.pool, tx=True) as conn:  # dropped if a statement overran
                yield Tx(Db(conn, self.lease_margin_s), self.node_ttl_s)

    def listener(
        self,
        handlers: Sequence[tuple[str, Handler]],
        on_reconnect: Callable[[], None] | None = None,
    ) -> PgListener:
        """A LISTEN connection of its own for these channels (see store.notify)."""
        return PgListener(self.dsn, handlers, on_reconnect)

    def lease_link(self) -> LeaseLink:
        return LeaseLink(self.dsn, self.lease_margin_s)

    def cluster_gauges(self) -> ClusterGauges:
        """The election and read of the once-per-deployment gauges (shared.metrics)."""
        return ClusterGauges(self.pool)

    async def expire_connections(self) -> None:
        """Drop pooled connections (after Postgres restarted, say)."""
        await self.pool.expire_connections()
