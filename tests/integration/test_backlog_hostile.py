"""The scheduler's sweeps and an operator's commands moving tasks an executor holds in its
backlog (shared/backlog.py, services/executor/start.py). Each case was found by an adversarial
review, where it failed: the docstrings say what happened; each test shows it no longer does.
The node's heartbeat is short here (HEARTBEAT_S), as the backlog is looked at each heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg

from services.executor.service import Executor
from services.scheduler.service import Scheduler
from shared import control
from shared.client import SkedClient
from shared.settings import Settings
from tests.helpers import eventually
from tests.integration.pipeline import services

HEARTBEAT_S = 0.3


@contextlib.asynccontextmanager
async def cluster(
    settings: Settings, tmp_path: Path, slots: int = 1, prefetch: int | None = 2, **kw: Any
) -> AsyncIterator[tuple[Scheduler, Executor, SkedClient]]:
    """A scheduler and one local executor (node n1) in this process."""
    node = {"prefetch": prefetch, "node_heartbeat_s": HEARTBEAT_S, **kw}
    async with services(settings, tmp_path, "n1", slots=slots, **node) as running:
        yield running.scheduler, running.executor, running.client


def sleep_job(seconds: float) -> dict[str, Any]:
    return {"kind": "command", "argv": ["sleep", str(seconds)]}


async def row(pool: asyncpg.Pool, task_id: Any) -> asyncpg.Record:
    return await pool.fetchrow(
        "SELECT status, attempt, node, started_at, finished_at FROM tasks WHERE id = $1", task_id
    )


def held_ids(executor: Executor) -> list[Any]:
    return [i.dispatch.task_id for i in executor.starter.held if i.dispatch is not None]


async def _status_is(pool: asyncpg.Pool, task_id: Any, status: str) -> bool:
    r = await row(pool, task_id)
    return r is not None and r["status"] == status


def entries(executor: Executor) -> list[Any]:
    """Every dispatch the executor keeps unclaimed: held, and waiting in its inbox."""
    items = list(executor.starter.held)
    for batch in list(executor.node.inbox._queue):  # type: ignore[attr-defined]
        items += batch or []
    return [(i.dispatch.task_id, i.dispatch.attempt) for i in items if i.dispatch is not None]


async def not_live(pool: asyncpg.Pool, kept: list[Any]) -> list[Any]:
    """The kept entries whose attempt is no longer Scheduling on n1 (nothing left to claim)."""
    rows = await pool.fetch(
        "SELECT id, attempt FROM tasks WHERE status = 'scheduling' AND node = 'n1'"
    )
    live = {(r["id"], r["attempt"]) for r in rows}
    return [k for k in kept if k not in live]


async def test_a_held_dispatch_failed_by_the_schedule_timeout_costs_the_next_no_claim(
    settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """Node n1 (1 slot, SKED_PREFETCH=2) runs A (6 s); B (schedule_timeout_s 1) is placed
    on n1 and held; the scheduler's schedule-timeout sweep fails B. Then L (no timeout) is
    placed on n1 and waits for the slot. Should: the executor lets go of B, and when A ends
    L is claimed in the statement writing A's outcome (docs/architecture.md, step 4). B's
    entry stayed held (a Failed move is not told to executors, and they only ever checked
    their running attempts), and kept the gated loop parked with L left in the inbox, where
    the outcome statement's claims did not look: A's outcome statement claimed B (lost), and
    L started one statement later. Now the held tasks are read each node heartbeat, and the
    outcome statement's claims take what waits in the inbox too."""
    async with cluster(settings, tmp_path) as (_s, executor, client):
        a = await client.submit({"name": "a", "job": sleep_job(6)})
        await eventually(lambda: _status_is(pool, a, "running"), timeout=15, what="A running")
        b = await client.submit({"name": "b", "job": sleep_job(0), "schedule_timeout_s": 1})
        await eventually(lambda: _held(executor, b), timeout=10, what="B held")
        await eventually(lambda: _status_is(pool, b, "failed"), timeout=10, what="B failed")
        l_ = await client.submit({"name": "l", "job": sleep_job(0)})
        await eventually(lambda: _status_is(pool, l_, "scheduling"), timeout=10, what="L placed")
        await eventually(lambda: _let_go(pool, executor), timeout=5, what="B let go")
        await eventually(lambda: _status_is(pool, l_, "success"), timeout=20, what="L ran")
        ra, rl = await row(pool, a), await row(pool, l_)
        gap = (rl["started_at"] - ra["finished_at"]).total_seconds()
        assert gap == 0, f"L started {gap:.4f}s after A's outcome statement, not in it"


async def test_dispatches_of_tasks_failed_while_held_do_not_pile_up(
    settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """Node n1 (1 slot, SKED_PREFETCH=50) runs A (20 s); three waves of 50 tasks with
    schedule_timeout_s 1 are placed on it (placement's room: 50), each failed by the
    schedule-timeout sweep before the next is submitted. Should: a node keeps at most what it
    advertised, letting go of the entries of tasks failed while held, which nothing can ever
    claim. The executor kept every one (each task's placement notification and its dispatch
    message: 300 entries for 150 tasks), growing with each wave for as long as A held the
    slot, since placement, counting from Postgres, saw the room free again; when the slot
    freed they were claimed one statement each, ahead of the live dispatch behind them."""
    async with cluster(settings, tmp_path, prefetch=50) as (_s, executor, client):
        a = await client.submit({"name": "a", "job": sleep_job(20)})
        await eventually(lambda: _status_is(pool, a, "running"), timeout=15, what="A running")
        for wave in range(3):
            some = await client.submit_many(
                [
                    {"name": f"t{wave}-{k}", "job": sleep_job(0), "schedule_timeout_s": 1}
                    for k in range(50)
                ]
            )

            async def all_failed(some: list[Any] = some) -> bool:
                n = await pool.fetchval(
                    "SELECT count(*) FROM tasks WHERE id = ANY($1) AND status = 'failed'", some
                )
                return bool(n == len(some))

            await eventually(all_failed, timeout=15, what="a wave failed")
            await eventually(lambda: _let_go(pool, executor), timeout=5, what="a wave let go")
            assert len(set(entries(executor))) <= executor.node.backlog.advertised


async def test_canceled_held_dispatches_are_let_go(
    settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """Node n1 (1 slot, SKED_PREFETCH=3) runs A (15 s) and holds three dispatches; an
    operator cancels all three (told to executors on sked_taken), then three more. Should:
    the backlog lets go of canceled held dispatches at once. The executor checked a taken
    task only against its running attempts: the held entries of the canceled tasks stayed
    (their messages unacknowledged) while placement filled the freed room again. Now a task
    taken away has the executor read its held tasks, at once, not at its next heartbeat (so
    the heartbeat here is long)."""
    slow = {"node_heartbeat_s": 30.0}
    async with cluster(settings, tmp_path, prefetch=3, **slow) as (s, executor, client):
        a = await client.submit({"name": "a", "job": sleep_job(15)})
        await eventually(lambda: _status_is(pool, a, "running"), timeout=15, what="A running")
        for wave in range(2):
            some = await client.submit_many(
                [{"name": f"c{wave}-{k}", "job": sleep_job(0)} for k in range(3)]
            )
            for t in some:
                await eventually(
                    lambda t=t: _status_is(pool, t, "scheduling"), timeout=10, what="placed"
                )
            await asyncio.sleep(0.8)  # their followed dispatch messages arrive too
            for t in some:
                await control.cancel(s.store, s.queue, t, "probe")
            await eventually(lambda: _let_go(pool, executor), timeout=3, what="a wave let go")


async def _held(executor: Executor, task_id: Any) -> bool:
    return task_id in held_ids(executor)


async def _let_go(pool: asyncpg.Pool, executor: Executor) -> bool:
    """Whether n1 keeps no entry of an attempt that is no longer Scheduling on it."""
    return not await not_live(pool, entries(executor))
