"""Workflows as stored: the DAG, its edges, and what decides a task downstream (the decisions
are shared.dag's; shared.workflows drives them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import asyncpg

from shared.errors import NotFound
from shared.fsm import State
from shared.models import Task
from shared.store.db import Db, missing, task
from shared.store.queries import Q
from shared.views import WorkflowSummary


@dataclass(frozen=True)
class OpenTask:
    """A workflow's task that has not ended, as far as a move needs it (fsm.TaskView)."""

    id: UUID
    status: State
    version: int
    attempt: int
    retry_count: int
    max_retries: int
    launch_failures: int
    max_launch_failures: int


class Workflows:
    def __init__(self, db: Db) -> None:
        self.db = db

    async def lock_open(self, workflow_id: UUID) -> list[OpenTask]:
        """Inside a transaction: lock the workflow's tasks that have not ended, in id order.
        Raises NotFound (or Purged) for an unknown workflow."""
        assert self.db.in_transaction, "the tasks stay locked until the transaction ends"
        rows = await self.db.fetch(Q.lock_open_tasks, workflow_id)
        if not rows and not await self.db.fetchval(Q.workflow_exists, workflow_id):
            raise await missing(self.db, "workflow", workflow_id)
        return [OpenTask(**{**row, "status": State(row["status"])}) for row in rows]

    async def insert(self, workflow_id: UUID, name: str, spec: dict[str, Any]) -> bool:
        """Record a workflow; False if it exists already (a redelivered submission)."""
        return await self.db.fetchval(Q.insert_workflow, workflow_id, name, spec) is not None

    async def spec(self, workflow_id: UUID) -> Any:
        """The spec a workflow was submitted with."""
        return await self.db.fetchval(Q.workflow_spec, workflow_id)

    async def insert_deps(
        self, deps: Sequence[tuple[UUID, UUID, str, float | None, str, str | None]]
    ) -> None:
        """(task, upstream, condition, timeout_s, on_timeout, default as JSON text) rows."""
        if deps:
            await self.db.execute(Q.insert_deps, *(list(x) for x in zip(*deps, strict=True)))

    async def downstream_of(self, upstream_ids: Sequence[UUID]) -> list[UUID]:
        return [r["task_id"] for r in await self.db.fetch(Q.downstream_of, list(upstream_ids))]

    async def pending_with_deps(self, limit: int, after: UUID | None = None) -> list[UUID]:
        """Up to `limit` Pending tasks with upstreams, in id order, after `after` if given."""
        rows = await self.db.fetch(Q.pending_with_deps, limit, after)
        return [r["task_id"] for r in rows]

    async def lock_pending(self, ids: Sequence[UUID]) -> list[Task]:
        """Inside a transaction: the Pending ones of these tasks, locked in id order."""
        return [task(r) for r in await self.db.fetch(Q.lock_pending, list(ids))]

    async def edges_of(self, ids: Sequence[UUID]) -> list[asyncpg.Record]:
        return await self.db.fetch(Q.edges_of, list(ids))

    async def inputs_sizes(self, ids: Sequence[UUID]) -> dict[UUID, int]:
        """{task: bytes of its succeeded upstreams' outputs, as Postgres writes them}."""
        return {r["task_id"]: r["bytes"] for r in await self.db.fetch(Q.inputs_sizes, list(ids))}

    async def upstream_results(self, ids: Sequence[UUID]) -> dict[tuple[UUID, UUID], Any]:
        """{(task, upstream): the upstream's result} for these tasks' succeeded upstreams."""
        rows = await self.db.fetch(Q.upstream_results, list(ids))
        return {(r["task_id"], r["upstream_id"]): r["result"] for r in rows}

    async def mark_timed_out(self, edges: Sequence[tuple[UUID, UUID]]) -> None:
        if edges:
            await self.db.execute(Q.mark_timed_out, *(list(x) for x in zip(*edges, strict=True)))

    async def lock(self, workflow_ids: Sequence[UUID]) -> None:
        """Inside a placement's transaction: lock these workflows, in id order, before their
        named resources' units are counted. The placement locks cover only the nodes live when
        a pass starts: two passes whose live nodes differ (one came or went between them) did
        not wait for each other, and each handed out the same last unit."""
        assert self.db.in_transaction, "the workflows' lock lasts the placement's transaction"
        await self.db.execute(Q.lock_workflows, sorted(workflow_ids))

    async def with_upstreams(self, workflow_id: UUID) -> set[UUID]:
        """The workflow's tasks that wait for upstreams."""
        return {r["task_id"] for r in await self.db.fetch(Q.workflow_edges, workflow_id)}

    async def resources_held(
        self, workflow_ids: Sequence[UUID]
    ) -> dict[tuple[UUID, str], tuple[int, int]]:
        """{(workflow, resource): (held, capacity)} for these workflows (placement reads it
        after `lock`, in a statement of its own, so that its snapshot follows the lock)."""
        if not workflow_ids:
            return {}
        rows = await self.db.fetch(Q.resources_held, list(workflow_ids))
        return {(r["workflow_id"], r["name"]): (r["held"], r["capacity"]) for r in rows}

    async def has_deps(self, task_id: UUID) -> bool:
        return bool(await self.db.fetchval(Q.has_deps, task_id))

    async def page(
        self, limit: int, after: UUID | None = None, name: str | None = None
    ) -> list[WorkflowSummary]:
        """Workflows newest first, `limit` at most, those after `after` (keyset paging),
        optionally of one name; each with its tasks counted. Raises NotFound for an unknown
        `after`."""
        rows = await self.db.fetch(Q.list_workflows, name, limit, after)
        if not rows and after and not await self.db.fetchval(Q.workflow_cursor_known, after):
            raise NotFound(f"no workflow {after} to list after")
        return [
            WorkflowSummary(r["id"], r["name"], r["created_at"], dict(r["counts"]), int(r["open"]))
            for r in rows
        ]

    async def get(
        self, workflow_id: UUID
    ) -> tuple[asyncpg.Record, list[Task], list[asyncpg.Record]]:
        """The workflow's row, its tasks and its edges, as of one moment: retention's purge
        committed between the reads left the row without its tasks (an empty workflow)."""
        async with self.db.snapshot() as db:
            row = await db.fetchrow(Q.get_workflow, workflow_id)
            if row is None:
                raise await missing(db, "workflow", workflow_id)
            tasks = [task(r) for r in await db.fetch(Q.workflow_tasks, workflow_id)]
            return row, tasks, await db.fetch(Q.workflow_edges, workflow_id)
