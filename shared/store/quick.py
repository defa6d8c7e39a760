"""One task read on a connection of its own, loading neither the store's aggregates nor
pydantic: the CLI's `sked status` (about 150 ms of its start went to imports it never used)."""

from __future__ import annotations

from uuid import UUID

import asyncpg

from shared.errors import NotFound
from shared.store.db import init_connection, task
from shared.store.queries import Q
from shared.task import Task


async def read_task(dsn: str, task_id: UUID) -> Task:
    """The task, as `Store.tasks.get` reads it; NotFound if there is none."""
    conn = await asyncpg.connect(dsn)
    try:
        await init_connection(conn)
        row = await conn.fetchrow(Q.get_task.sql, task_id)
    finally:
        await conn.close()
    if row is None:
        raise NotFound(f"no task {task_id}")
    return task(row)
