"""A node's backlog end to end (shared/backlog.py), services as separate processes: a node
earns a backlog by running short attempts, and what it holds behind long ones goes back to
Ready — in its place in line — for another node to run."""

from __future__ import annotations

from typing import Any

import asyncpg

from shared.backlog import ROUNDS
from shared.client import SkedClient
from shared.fsm import State
from tests.e2e.conftest import Deployment
from tests.helpers import eventually

ENV = {"SKED_BACKLOG_HOLD_S": "1", "SKED_NODE_HEARTBEAT_S": "0.5"}


def nap(name: str, ms: float) -> dict[str, Any]:
    return {
        "name": name,
        "job": {"kind": "handler", "handler": "tests.e2e.jobs:nap", "args": {"ms": ms}},
    }


async def test_a_backlog_is_earned_by_short_attempts_and_handed_back_behind_long_ones(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("busy", 2, env=ENV)

    async def backlog() -> int:
        return int(await pool.fetchval("SELECT prefetch FROM nodes WHERE id = 'busy'"))

    assert await backlog() == 0  # none until earned
    short = await client.submit_many([nap(f"short{i}", 0) for i in range(40)])
    await client.wait_all(short, timeout=60)
    # a full window of short attempts: a backlog of whole rounds of the node's slots, as
    # many as their mean allows (up to ROUNDS; a loaded host's attempts may earn fewer)
    await eventually(lambda: _earned(backlog), timeout=10, what="the backlog earned")

    long = await client.submit_many([nap(f"long{i}", 60_000) for i in range(2)])
    await eventually(lambda: _count(pool, long, "running"), timeout=30, what="both slots taken")
    held = await client.submit_many([nap(f"held{i}", 0) for i in range(2)])
    await eventually(lambda: _count(pool, held, "scheduling"), timeout=30, what="two held")
    queued = {t: (await client.get(t)).queued_at for t in held}
    # nothing frees a slot: after SKED_BACKLOG_HOLD_S both go back, and the node holds none
    await eventually(lambda: _count(pool, held, "ready"), timeout=15, what="handed back")
    await eventually(lambda: _is(backlog, 0), timeout=10, what="the backlog withdrawn")

    await deployment.executor("idle", 2, env=ENV)
    done = await client.wait_all(held, timeout=60)
    for task_id, task in done.items():
        assert task.status is State.SUCCESS, task
        assert task.node == "idle"
        assert task.queued_at == queued[task_id]  # its place in line kept
        back = [
            e
            for e in await client.history(task_id)
            if e.from_status is State.SCHEDULING and e.to_status is State.READY
        ]
        assert len(back) == 1
        assert "held on node busy" in back[0].reason
    for task_id in long:
        await client.cancel(task_id, "the test is over")
    await client.wait_all(long, timeout=30)


async def _earned(read: Any, slots: int = 2) -> bool:
    depth = await read()
    return bool(0 < depth <= ROUNDS * slots and depth % slots == 0)


async def _is(read: Any, value: int) -> bool:
    return bool(await read() == value)


async def _count(pool: asyncpg.Pool, ids: list[Any], status: str) -> bool:
    n = await pool.fetchval(
        "SELECT count(*) FROM tasks WHERE id = ANY($1) AND status = $2", ids, status
    )
    return bool(n == len(ids))
