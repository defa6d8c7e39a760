"""Nodes gone for long are forgotten (recovery deletes their rows, SKED_NODE_FORGET_S), so that
executors that come and go do not pile up in every placement's read — but never a node that
still holds an attempt or that an operator cordoned, and an executor that comes back serves
its node anew."""

from __future__ import annotations

from uuid import uuid4

import asyncpg
import pytest

from services.executor.service import Executor
from services.executor.serving import Serving
from services.recovery.service import Recovery
from shared.errors import InvalidSettings
from shared.relay import OutboxRelay
from shared.settings import Settings
from shared.store import Store
from tests.helpers import spec

HOUR = 3600.0


async def _register(store: Store, pool: asyncpg.Pool, node_id: str, silent_s: float) -> None:
    await store.nodes.register(node_id, 2, 1.0, 64, 0, {}, uuid4())
    await pool.execute(
        "UPDATE nodes SET heartbeat_at = now() - make_interval(secs => $2) WHERE id = $1",
        node_id,
        silent_s,
    )


async def test_gone_nodes_are_forgotten_unless_held_or_cordoned(
    store: Store, pool: asyncpg.Pool
) -> None:
    for node_id in ("gone", "held", "cordoned"):
        await _register(store, pool, node_id, 2 * HOUR)
    await _register(store, pool, "recent", HOUR / 2)
    await _register(store, pool, "live", 0)
    await store.nodes.cordon("cordoned", "ops", "a disk is being replaced")
    task = await store.tasks.create(spec("stuck there"))
    # test-only: an attempt still counted on the node (its loss not yet confirmed)
    await pool.execute("UPDATE tasks SET status = 'running', node = 'held' WHERE id = $1", task.id)

    assert await store.nodes.forget(HOUR) == ["gone"]
    assert sorted(n.id for n in await store.nodes.all()) == ["cordoned", "held", "live", "recent"]
    assert await store.nodes.forget(HOUR) == []
    # it comes back: registered anew, as any node is
    await store.nodes.register("gone", 2, 1.0, 64, 0, {}, uuid4())
    assert "gone" in {n.id for n in await store.nodes.all()}


async def test_recovery_forgets_at_most_once_a_minute(
    settings: Settings, store: Store, pool: asyncpg.Pool
) -> None:
    forgetting = settings.model_copy(update={"node_forget_s": 2 * HOUR})
    recovery = Recovery(forgetting, store, None, OutboxRelay(store, None, 1))  # type: ignore[arg-type]
    await _register(store, pool, "old", 3 * HOUR)
    assert await recovery.forget_nodes() == ["old"]
    await _register(store, pool, "older", 4 * HOUR)
    assert await recovery.forget_nodes() == []  # looked a moment ago
    never = settings.model_copy(update={"node_forget_s": 0})
    recovery = Recovery(never, store, None, OutboxRelay(store, None, 1))  # type: ignore[arg-type]
    assert await recovery.forget_nodes() == []
    assert "older" in {n.id for n in await store.nodes.all()}


def test_a_node_is_forgotten_only_once_nothing_counts_it() -> None:
    with pytest.raises(InvalidSettings, match="SKED_DEGRADE_NODES_SEEN_S"):
        Settings(node_forget_s=600, degrade_nodes_seen_s=3600)
    assert Settings(node_forget_s=0).node_forget_s == 0
    assert Settings(node_forget_s=3600, degrade_nodes_seen_s=3600).node_forget_s == 3600


async def test_an_executor_serves_its_forgotten_node_anew(executor: Executor, store: Store) -> None:
    """A local executor cut off from Postgres for longer than SKED_NODE_FORGET_S finds its row
    gone: that is no takeover, and it registers its node again. A row another executor owns
    now is one: it stops."""
    node = executor.node
    channel = await node.bus.consumer_channel(prefetch=4)
    probes = await channel.declare_queue(exclusive=True, auto_delete=True)
    serving = Serving(node, channel, probes)
    try:
        await serving.sync()
        assert await store.nodes.owner("n1") == node.boot_id
        await store.pool.execute("DELETE FROM nodes WHERE id = 'n1'")  # as forget_nodes does
        assert await serving.beat() is True
        assert await store.nodes.owner("n1") is None
        await serving.sync()
        assert await store.nodes.owner("n1") == node.boot_id
        await store.pool.execute("UPDATE nodes SET boot_id = $1 WHERE id = 'n1'", uuid4())
        assert await serving.beat() is False
    finally:
        await channel.close()
