"""One task read on a connection of its own, loading neither the store's aggregates nor
pydantic: the CLI's `sked status` (about 150 ms of its start went to imports it never used)."""

from __future__ import annotations

from uuid import UUID

import asyncpg

from shared.store.db import Db, get_task, init_connection
from shared.task import Task


async def read_task(dsn: str, task_id: UUID) -> Task:
    """The task, as `Store.tasks.get` reads it; NotFound if there is none."""
    conn = await asyncpg.connect(dsn)
    try:
        await init_connection(conn)
        return await get_task(Db(conn, lease_margin_s=0.0), task_id)
    finally:
        await conn.close()
