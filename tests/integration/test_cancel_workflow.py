"""Canceling a whole workflow against real Postgres: every task not ended moves to Canceled,
in batches, a running one too (its executor hears the move and stops the attempt: the e2e
tests), what ended stays as it ended, and nothing downstream is released."""

from __future__ import annotations

from uuid import UUID, uuid4

import asyncpg
import pytest

from shared import control, fsm, workflows
from shared.control import NotAllowed
from shared.dag import WorkflowSpec
from shared.errors import NotFound
from shared.fsm import State
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
    monkeypatch.setattr(control, "WORKFLOW_CANCEL_BATCH", batch)
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
