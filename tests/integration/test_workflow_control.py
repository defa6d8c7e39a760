"""Controlling a whole workflow against real Postgres (pause, resume, cancel). Canceling: every
task not ended moves to Canceled, in batches, a running one too (its executor hears the move
and stops the attempt: the e2e tests), what ended stays as it ended, and nothing downstream is
released."""

from __future__ import annotations

from collections.abc import AsyncIterator
from uuid import UUID, uuid4

import asyncpg
import pytest
from redis.asyncio import Redis

from shared import control, fsm, workflows
from shared.control import NotAllowed
from shared.dag import WorkflowSpec
from shared.errors import NotFound
from shared.fsm import State
from shared.queues import ReadyQueue
from shared.store import Store

WF = WorkflowSpec.parse(
    {
        "name": "wf",
        "tasks": [
            {"name": "done", "command": ["true"]},
            {"name": "busy", "command": ["true"]},
            {"name": "after", "command": ["true"], "needs": ["busy"]},
            {
                "name": "cleanup",
                "command": ["true"],
                "needs": [{"task": "busy", "condition": "always"}],
            },
        ],
    }
)


async def _admitted(store: Store, pool: asyncpg.Pool) -> tuple[UUID, dict[str, UUID]]:
    """The workflow with `done` ended and `busy` running; the others Pending."""
    wf_id = uuid4()
    await workflows.admit(store, wf_id, WF)
    ids = {t.name: workflows.task_id(wf_id, t.name) for t in WF.tasks}
    await pool.execute(
        "UPDATE tasks SET status = 'success', finished_at = now() WHERE id = $1", ids["done"]
    )
    busy = await store.tasks.get(ids["busy"])
    busy = await fsm.apply(store.tasks, busy, State.SCHEDULING, node="n1")
    await fsm.apply(store.tasks, busy, State.RUNNING, lease_owner=str(uuid4()))
    return wf_id, ids


@pytest.mark.parametrize("batch", [1000, 1])
async def test_every_task_not_ended_is_canceled(
    store: Store, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    monkeypatch.setattr(control, "WORKFLOW_BATCH", batch)
    wf_id, ids = await _admitted(store, pool)
    canceled = await control.cancel_workflow(store, None, wf_id, "obsolete", by="ann")
    assert sorted(t.wf_task or "" for t in canceled) == ["after", "busy", "cleanup"]
    assert {t.status for t in canceled} == {State.CANCELED}
    view = await store.workflows.get(wf_id)
    states = {t.wf_task: t.status for t in view[1]}
    assert states == {
        "done": State.SUCCESS,
        "busy": State.CANCELED,
        "after": State.CANCELED,
        "cleanup": State.CANCELED,  # even `always`: canceled, not released
    }
    history = await store.tasks.history(ids["busy"])
    assert history[-1].reason == f"canceled with workflow {wf_id} by ann: obsolete"
    with pytest.raises(NotAllowed, match="has ended"):
        await control.cancel_workflow(store, None, wf_id)
    with pytest.raises(NotFound):
        await control.cancel_workflow(store, None, uuid4())


@pytest.fixture
async def queue(redis_url: str) -> AsyncIterator[ReadyQueue]:
    redis = Redis.from_url(redis_url)
    yield ReadyQueue(redis, 5.0)
    await redis.aclose()


async def test_a_workflow_paused_whole_and_resumed_whole(
    store: Store, pool: asyncpg.Pool, queue: ReadyQueue
) -> None:
    """Pause stops the running task and holds the waiting ones where nothing releases them;
    resume brings each back as `resume` does one: a task without upstreams to Ready and into
    the queue, the others to Pending, where the scheduler judges their dependencies again."""
    wf_id, ids = await _admitted(store, pool)
    paused = await control.pause_workflow(store, queue, wf_id, "maintenance", by="ann")
    assert sorted(t.wf_task or "" for t in paused) == ["after", "busy", "cleanup"]
    assert {(t.status, t.paused_by, t.paused_reason) for t in paused} == {
        (State.PAUSED, "ann", "maintenance")
    }
    with pytest.raises(NotAllowed, match="has ended or is paused"):
        await control.pause_workflow(store, queue, wf_id, "again")

    resumed = await control.resume_workflow(store, queue, wf_id, by="bob")
    assert {t.wf_task: t.status for t in resumed} == {
        "busy": State.READY,  # no upstream: straight back in line
        "after": State.PENDING,
        "cleanup": State.PENDING,
    }
    assert await queue.size() == 1
    history = await store.tasks.history(ids["busy"])
    assert [e.to_status for e in history[-3:]] == [State.PAUSED, State.PENDING, State.READY]
    assert history[-2].reason == f"resumed with workflow {wf_id} by bob"
    assert (await store.tasks.get(ids["done"])).status is State.SUCCESS  # ended: untouched
    with pytest.raises(NotAllowed, match="no task of it is paused"):
        await control.resume_workflow(store, queue, wf_id)
