"""One task read on a connection of its own, loading neither the store's aggregates nor
pydantic: the CLI's `sked status` (about 150 ms of its start went to imports it never used).

The connection gets no jsonb codec: setting one makes asyncpg look the type up first, a round
trip and a catalogue query that cost as much as the read itself. The two jsonb columns of a
task arrive as text and are parsed here, as the codec would have."""

from __future__ import annotations

import json
from uuid import UUID

import asyncpg

from shared.errors import NotFound
from shared.store.queries import Q
from shared.task import Task

JSONB_COLUMNS = ("result", "inputs")


async def read_task(dsn: str, task_id: UUID) -> Task:
    """The task, as `Store.tasks.get` reads it; NotFound if there is none."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(Q.get_task.sql, task_id)
    finally:
        await conn.close()
    if row is None:
        raise NotFound(f"no task {task_id}")
    values = dict(row)
    for column in JSONB_COLUMNS:
        if values[column] is not None:
            values[column] = json.loads(values[column])
    return Task.from_row(values)
