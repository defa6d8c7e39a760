"""The once-per-deployment gauges on a real Postgres and Redis: one process at a time holds
the advisory lock and reads them; giving it up (or dying) lets another take it."""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import pytest
from redis.asyncio import Redis

from shared import metrics
from shared.fsm import State
from shared.queues import ReadyQueue
from shared.settings import Settings
from shared.store import Store
from tests.helpers import eventually, spec

READY = (State.PENDING, State.READY)


async def test_one_process_leads_and_another_takes_over(store: Store, dsn: str) -> None:
    other = await Store.connect(dsn, 2)
    first, second = store.cluster_gauges(), other.cluster_gauges()
    try:
        assert await first.lead()
        assert await first.lead()  # held: no new try
        assert not await second.lead()
        await store.tasks.create_many([spec("a"), spec("b")], walk=READY)
        counts = await first.read(metrics.CLUSTER_STATES)
        assert counts.tasks["ready"] == 2
        assert counts.tasks["running"] == 0
        assert counts.outbox_backlog >= 6  # created -> pending -> ready, per task
        assert counts.relay_lag_s >= 0
        with pytest.raises(AssertionError):
            await second.read(metrics.CLUSTER_STATES)
        await first.resign()
        assert await second.lead()
        assert not await first.lead()
    finally:
        await first.resign()  # a pool waits for its connections at close
        await second.resign()
        await other.close()


async def test_a_dead_leaders_lock_is_taken_by_another(store: Store, dsn: str) -> None:
    first = store.cluster_gauges()
    try:
        assert await first.lead()
        # the leader's session ends as a killed process's would
        assert first._conn is not None
        pid = first._conn.get_server_pid()
        admin = await asyncpg.connect(dsn)
        try:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
        finally:
            await admin.close()
        broken = (
            asyncpg.PostgresError,
            asyncpg.InterfaceError,
            asyncpg.InternalClientError,
            OSError,
        )
        with pytest.raises(broken):
            await first.read(metrics.CLUSTER_STATES)
    finally:
        await first.resign()
    other = await Store.connect(dsn, 2)
    try:
        second = other.cluster_gauges()
        assert await eventually(second.lead, what="the lock to be free")
        await second.resign()
    finally:
        await other.close()


async def test_the_cluster_loop_exports_the_gauges_while_it_leads(
    store: Store, settings: Settings
) -> None:
    redis = Redis.from_url(settings.redis_url)
    queue = ReadyQueue(redis, settings.aging_s)
    on = settings.model_copy(update={"metrics_port": 0, "metrics_cluster_s": 0.05})
    try:
        tasks = await store.tasks.create_many([spec("x")], walk=READY)
        await queue.push(tasks)
        async with metrics.cluster(on, store, queue):

            async def exported() -> bool:
                latest = metrics.CLUSTER.latest
                return latest is not None and latest[1]["ready"] == 1

            await eventually(exported, timeout=10, what="the gauges to be read")
            assert metrics.CLUSTER.latest is not None
            assert metrics.CLUSTER.latest[0].tasks["ready"] == 1
        assert metrics.CLUSTER.latest is None  # stopped: no stale values exported
        again = store.cluster_gauges()  # the lock went back with its connection
        async with asyncio.timeout(5):
            assert await again.lead()
        await again.resign()
    finally:
        with contextlib.suppress(Exception):
            await redis.aclose()


async def test_a_lead_whose_answer_is_lost_leaves_no_lock_in_the_pool(
    store: Store, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server grants the lock, and the answer is lost (the statement's timeout): the
    connection went back to the pool holding the lock for good, and no process could lead
    again. Now it is terminated, and the lock with it."""
    from shared.store.queries import Q

    real = asyncpg.connection.Connection.fetchval

    async def granted_then_lost(self: asyncpg.Connection, query: str, *args: object, **kw: object):  # type: ignore[no-untyped-def]
        value = await real(self, query, *args, **kw)
        if query == Q.lead_gauges.sql:
            raise TimeoutError
        return value

    other = await Store.connect(dsn, 2)
    try:
        monkeypatch.setattr(asyncpg.connection.Connection, "fetchval", granted_then_lost)
        with pytest.raises(TimeoutError):
            await store.cluster_gauges().lead()
        monkeypatch.undo()
        second = other.cluster_gauges()
        await eventually(second.lead, timeout=10, what="another process leads")
        await second.resign()
    finally:
        await other.close()
