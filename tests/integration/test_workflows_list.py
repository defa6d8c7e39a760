"""Listing workflows against real Postgres: newest first by pages (keyset, as tasks), by
name, each with its tasks counted by state and its status — which a Failed task with a
retry left does not end."""

from __future__ import annotations

from uuid import UUID, uuid4

import asyncpg
import pytest

from shared import workflows
from shared.dag import WorkflowSpec
from shared.errors import NotFound
from shared.store import Store


def _spec(name: str) -> WorkflowSpec:
    return WorkflowSpec.parse(
        {
            "name": name,
            "tasks": [
                {"name": "a", "command": ["true"]},
                {"name": "b", "command": ["true"], "needs": ["a"]},
            ],
        }
    )


async def _put(pool: asyncpg.Pool, wf: UUID, name: str, status: str, retries: int = 0) -> None:
    """Test-only: one task of the workflow straight into a state."""
    await pool.execute(
        "UPDATE tasks SET status = $2, retry_count = $3, max_retries = 1 WHERE id = $1",
        workflows.task_id(wf, name),
        status,
        retries,
    )


async def test_workflows_page_newest_first_with_their_status(
    store: Store, pool: asyncpg.Pool
) -> None:
    ids = []
    for name in ("nightly", "backfill", "nightly", "nightly"):
        wf = uuid4()
        await workflows.admit(store, wf, _spec(name))
        ids.append(wf)
    oldest, second, third, newest = ids
    await _put(pool, oldest, "a", "success")
    await _put(pool, oldest, "b", "failed", retries=1)  # retries spent: failed
    await _put(pool, second, "a", "success")
    await _put(pool, second, "b", "success")
    await _put(pool, third, "a", "failed", retries=0)  # a retry left: not over yet
    await _put(pool, newest, "a", "paused")

    listed = await store.workflows.page(10)
    assert [w.id for w in listed] == [newest, third, second, oldest]
    assert [w.status() for w in listed] == ["paused", "running", "succeeded", "failed"]
    assert listed[1].counts == {"failed": 1, "pending": 1}
    assert [w.open for w in listed] == [2, 2, 0, 0]

    first = await store.workflows.page(3, name="nightly")
    assert [w.id for w in first] == [newest, third, oldest]
    assert await store.workflows.page(3, after=first[1].id, name="nightly") == first[2:]
    assert await store.workflows.page(3, after=oldest) == []
    with pytest.raises(NotFound, match="to list after"):
        await store.workflows.page(3, after=uuid4())
