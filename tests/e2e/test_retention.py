"""Retention end to end (SKED_RETENTION_DAYS): recovery deletes finished tasks with their
history once the retention has passed, a workflow whole; an executor deletes their log files;
a task still running stays, and its log with it, however long it has been silent."""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

import asyncpg
import pytest

from shared import workflows
from shared.client import SkedClient
from shared.errors import NotFound
from shared.fsm import State
from tests.e2e.conftest import Deployment
from tests.helpers import eventually

KEPT_S = 3.0
RETENTION = {"SKED_RETENTION_DAYS": repr(KEPT_S / 86_400), "SKED_RETENTION_CHECK_S": "0.3"}


async def _rows(pool: asyncpg.Pool, ids: list[UUID]) -> tuple[int, int]:
    """The rows of these tasks, and of their history."""
    tasks = await pool.fetchval("SELECT count(*) FROM tasks WHERE id = ANY($1::uuid[])", ids)
    events = await pool.fetchval(
        "SELECT count(*) FROM task_events WHERE task_id = ANY($1::uuid[])", ids
    )
    return tasks, events


async def test_finished_tasks_go_once_the_retention_has_passed(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("n1", 2, env=RETENTION)
    recovery = await deployment.start("recovery", env=RETENTION)
    echo = await client.submit(
        {"name": "echo", "job": {"kind": "command", "argv": ["sh", "-c", "echo hi"]}}
    )
    silent = await client.submit(
        {"name": "silent", "job": {"kind": "command", "argv": ["sleep", "60"]}}
    )
    wf_id = await client.submit_workflow(
        {
            "name": "pair",
            "tasks": [
                {"name": "a", "command": ["true"]},
                {"name": "b", "command": ["true"], "needs": ["a"]},
            ],
        }
    )
    pair = [workflows.task_id(wf_id, name) for name in ("a", "b")]
    done = await client.wait_all([echo, *pair], timeout=30)
    assert all(t.status is State.SUCCESS for t in done.values()), done
    (logs,) = tmp_path.glob("state-n1-*/logs")
    assert {f"{echo}-1.log", f"{silent}-1.log"} <= {p.name for p in logs.iterdir()}
    tasks, events = await _rows(pool, [echo, *pair])
    assert (tasks, events >= 3 * 6) == (3, True)

    async def purged() -> bool:
        return await _rows(pool, [echo, *pair]) == (0, 0)

    await eventually(purged, timeout=30, what="the finished tasks purged")
    for gone in (client.get(echo), client.workflow(wf_id)):
        with pytest.raises(NotFound):
            await gone
    await eventually(
        lambda: _absent(logs / f"{echo}-1.log"), timeout=30, what="the ended attempt's log pruned"
    )
    # the silent task has run (and its log gone unwritten) longer than the retention: it stays
    assert (await client.get(silent)).status is State.RUNNING
    assert (logs / f"{silent}-1.log").exists()
    assert "retention: deleted" in recovery.log()
    await client.cancel(silent, "seen enough")
    assert (await client.wait(silent, timeout=30)).status is State.CANCELED


async def _absent(path: Path) -> bool:
    return not path.exists()
