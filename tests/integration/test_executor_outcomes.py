"""The executor's outcome write on real Postgres: a write retried after its COMMIT went through
(the reply lost) is not mistaken for a late result; a genuinely superseded attempt is kept,
not applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg

from services.executor.backend import LocalBackend, Outcome
from services.executor.service import Attempt, Executor
from shared import fsm
from shared.fsm import State
from shared.models import Task
from shared.settings import Settings
from shared.wiring import backends
from tests.helpers import spec


async def running(executor: Executor, name: str) -> Task:
    task = await executor.repo.create(spec(name))
    for target in (State.PENDING, State.READY, State.SCHEDULING, State.RUNNING):
        task = await fsm.apply(executor.repo, task, target)
    return task


async def late_rows(pool: asyncpg.Pool) -> list[Any]:
    return list(await pool.fetch("SELECT task_id, attempt, ok FROM late_results"))


async def test_a_retried_write_after_a_lost_reply_is_not_late(
    settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    node = settings.model_copy(update={"node_id": "n1", "slots": 1})
    async with backends(node) as b:
        executor = Executor(node, b.tasks, b.nodes, b.bus, LocalBackend(1, tmp_path), b.ready_queue)
        mine, moved_on = await running(executor, "mine"), await running(executor, "moved-on")
        ok = Outcome(True, 42, None, False, False, "")
        batch = [(Attempt(mine, None), ok)]  # type: ignore[arg-type]

        assert await executor._write_outcomes(batch) == []
        # the same write again, as after a lost COMMIT reply: it loses its CAS to itself
        assert await executor._write_outcomes(batch) == []
        assert await late_rows(pool) == []
        assert (await b.tasks.get(mine.id)).result == 42

        # an attempt that lost its task to someone else (canceled) is kept, not applied
        await fsm.apply(executor.repo, moved_on, State.CANCELED, reason="operator")
        late = await executor._write_outcomes([(Attempt(moved_on, None), ok)])  # type: ignore[arg-type]
        assert [t.id for t, _ in late] == [moved_on.id]
        assert [(r["task_id"], r["attempt"], r["ok"]) for r in await late_rows(pool)] == [
            (moved_on.id, 1, True)
        ]
        assert (await b.tasks.get(moved_on.id)).status is State.CANCELED
