"""Changing a task's priority on real Postgres and Redis: a workflow's upstreams inherit it at
once (brief §7), the ready queue re-scores what is waiting, and bad requests change nothing."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from typing import Any
from uuid import uuid4

import asyncpg
import pytest
from redis.asyncio import Redis

from shared import control, fsm, workflows
from shared.control import NotAllowed
from shared.dag import WorkflowSpec
from shared.errors import InvalidSpec
from shared.fsm import State
from shared.queues import ReadyQueue
from shared.store import Store
from tests.helpers import SKED, spec


@pytest.fixture
async def queue(redis_url: str) -> AsyncIterator[ReadyQueue]:
    redis = Redis.from_url(redis_url)
    yield ReadyQueue(redis, aging_s=60.0)
    await redis.aclose()


def task(name: str, priority: int, *needs: str) -> dict[str, Any]:
    return {"name": name, "command": ["true"], "priority": priority, "needs": list(needs)}


async def admit(store: Store, queue: ReadyQueue, *tasks: dict[str, Any]) -> dict[str, Any]:
    workflow_id = uuid4()
    ready = await workflows.admit(
        store, workflow_id, WorkflowSpec.parse({"name": "w", "tasks": tasks})
    )
    await queue.push(ready)
    rows = await store.pool.fetch(
        "SELECT wf_task, id FROM tasks WHERE workflow_id = $1", workflow_id
    )
    return {r["wf_task"]: await store.tasks.get(r["id"]) for r in rows}


async def priorities(store: Store, tasks: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """{name: (effective priority, own priority)}"""
    out = {}
    for name, t in tasks.items():
        now = await store.tasks.get(t.id)
        out[name] = (now.priority, now.spec.priority)
    return out


async def test_raising_a_downstream_task_lifts_its_upstreams_and_requeues_them(
    store: Store, queue: ReadyQueue
) -> None:
    other = await store.tasks.create_many(
        [spec("mid", priority=5)], walk=(State.PENDING, State.READY)
    )
    await queue.push(other)
    tasks = await admit(
        store,
        queue,
        task("extract", 1),
        task("clean", 0, "extract"),
        task("report", 1, "clean"),
        task("side", 0),  # not upstream of report: untouched
    )
    assert await queue.pop(1) == [other[0].id]  # priority 5 ahead of the workflow's 1
    await queue.push(other)

    changed = await control.set_priority(store, queue, tasks["report"].id, 9)
    assert changed[0].wf_task == "report"  # the task itself first
    assert {t.wf_task for t in changed} == {"report", "clean", "extract"}
    assert await priorities(store, tasks) == {
        "extract": (9, 1),
        "clean": (9, 0),
        "report": (9, 9),
        "side": (0, 0),
    }
    # extract is Ready: re-scored in place, it now goes before the priority-5 task
    assert await queue.pop(1) == [tasks["extract"].id]

    # lowering it again hands each task back the highest of its own and its downstream's
    await control.set_priority(store, queue, tasks["report"].id, 0)
    assert await priorities(store, tasks) == {
        "extract": (1, 1),
        "clean": (0, 0),
        "report": (0, 0),
        "side": (0, 0),
    }


async def test_a_plain_task_and_the_requests_that_are_refused(
    store: Store, queue: ReadyQueue, pool: asyncpg.Pool
) -> None:
    [plain] = await store.tasks.create_many(
        [spec("p", priority=2)], walk=(State.PENDING, State.READY)
    )
    changed = await control.set_priority(store, queue, plain.id, -3)
    assert [(t.id, t.priority, t.spec.priority) for t in changed] == [(plain.id, -3, -3)]

    with pytest.raises(InvalidSpec, match="priority must be within"):
        await control.set_priority(store, queue, plain.id, 5000)
    done = await fsm.apply(
        store.tasks, await store.tasks.get(plain.id), State.CANCELED, reason="test"
    )
    before = await pool.fetchrow("SELECT priority, spec FROM tasks WHERE id = $1", done.id)
    with pytest.raises(NotAllowed, match="Canceled, a terminal state"):
        await control.set_priority(store, queue, done.id, 7)
    assert await pool.fetchrow("SELECT priority, spec FROM tasks WHERE id = $1", done.id) == before


async def test_the_priority_command(
    store: Store, queue: ReadyQueue, service_env: dict[str, str]
) -> None:
    tasks = await admit(store, queue, task("up", 0), task("down", 0, "up"))

    def sked(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [SKED, *args], env=service_env, capture_output=True, text=True, timeout=60
        )

    done = sked("priority", str(tasks["down"].id), "4")
    assert done.returncode == 0, done.stderr
    assert f"{tasks['down'].id} down: priority 4" in done.stdout
    assert f"{tasks['up'].id} up: priority 4 (own 0, inherited from downstream)" in done.stdout
    status = sked("status", str(tasks["up"].id))
    assert "priority:  4 (own 0, inherited)" in status.stdout
    refused = sked("priority", str(tasks["down"].id), "99999")
    assert refused.returncode == 2
    assert "priority must be within [-1000, 1000]" in refused.stderr
