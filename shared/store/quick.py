"""One task read on a connection of its own, loading neither the store's aggregates nor
pydantic: the CLI's `sked status`.

`read_task_now` reads through libpq (shared.store.libpq), synchronously, loading neither
asyncio nor asyncpg (together ~60 ms of the command's start); `read_task` is the same read on
asyncpg, where libpq is not installed.

The asyncpg connection gets no jsonb codec: setting one makes asyncpg look the type up first,
a round trip and a catalogue query that cost as much as the read itself. The two jsonb columns
of a task arrive as text and are parsed here, as the codec would have."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields
from datetime import datetime
from typing import Any
from uuid import UUID

from shared.errors import missing
from shared.store.libpq import CONNECT_TIMEOUT_S, QUERY_TIMEOUT_S
from shared.store.queries import Q
from shared.task import Task

JSONB_COLUMNS = ("result", "inputs")


def _converter(annotation: str) -> Callable[[Any], Any] | None:
    """How a JSON value becomes the field's type (annotations are strings here)."""
    if "UUID" in annotation:
        return UUID
    if "datetime" in annotation:
        return datetime.fromisoformat
    if annotation.startswith("float"):
        return float  # JSON writes 2.0 as 2
    return None


_CONVERT = {f.name: c for f in fields(Task) if (c := _converter(str(f.type))) is not None}


def task_from_json(text: str) -> Task:
    """A task from the JSON object of its columns (row_to_json of get_task's columns)."""
    values = json.loads(text)
    for name, convert in _CONVERT.items():
        if values.get(name) is not None:
            values[name] = convert(values[name])
    return Task.from_row(values)


def read_task_now(dsn: str, task_id: UUID) -> Task:
    """The task, as `Store.tasks.get` reads it, through libpq; NotFound if there is none.
    Raises shared.store.libpq.Unavailable where libpq is not installed."""
    from shared.store.libpq import fetch_text

    text = fetch_text(dsn, Q.get_task_json.sql, [str(task_id)])
    if text is None:
        at = fetch_text(dsn, Q.purged_when_text.sql, [str(task_id)])
        raise missing("task", task_id, at)
    return task_from_json(text)


async def read_task(dsn: str, task_id: UUID) -> Task:
    """The task, as `Store.tasks.get` reads it, through asyncpg; NotFound if there is none."""
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT_S)
    try:
        row = await conn.fetchrow(Q.get_task.sql, task_id, timeout=QUERY_TIMEOUT_S)
        at = None
        if row is None:
            at = await conn.fetchval(Q.purged_when.sql, task_id, timeout=QUERY_TIMEOUT_S)
    finally:
        await conn.close()
    if row is None:
        raise missing("task", task_id, at)
    values = dict(row)
    for column in JSONB_COLUMNS:
        if values[column] is not None:
            values[column] = json.loads(values[column])
    return Task.from_row(values)
