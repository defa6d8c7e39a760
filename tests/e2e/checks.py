"""Invariant checks over what Postgres recorded: legal histories, no overlapping attempts."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from uuid import UUID

import asyncpg

from shared import fsm
from shared.fsm import State

TABLE = {(r.source, r.target) for r in fsm.TRANSITIONS}


async def histories(pool: asyncpg.Pool) -> dict[UUID, list[asyncpg.Record]]:
    rows = await pool.fetch(
        "SELECT task_id, from_status, to_status, version, attempt, at FROM task_events "
        "ORDER BY task_id, version"
    )
    out: dict[UUID, list[asyncpg.Record]] = defaultdict(list)
    for row in rows:
        out[row["task_id"]].append(row)
    return out


def check_history(task_id: UUID, events: list[asyncpg.Record]) -> None:
    """Versions 1..N without gaps, each move legal and continuing from the previous state, and
    an attempt runs only after the previous attempt left Running."""
    assert [e["version"] for e in events] == list(range(1, len(events) + 1)), task_id
    assert events[0]["from_status"] is None
    assert events[0]["to_status"] == "created"
    running: int | None = None
    for prev, cur in itertools.pairwise(events):
        pair = (State(cur["from_status"]), State(cur["to_status"]))
        assert pair in TABLE, f"{task_id}: illegal {pair}"
        assert cur["from_status"] == prev["to_status"], f"{task_id}: history jumps at {cur}"
        assert cur["attempt"] >= prev["attempt"], f"{task_id}: attempt went down at {cur}"
        if cur["to_status"] == "running":
            assert running is None, f"{task_id}: attempt {cur['attempt']} ran beside {running}"
            running = cur["attempt"]
        elif cur["from_status"] == "running":
            running = None


async def check_all_histories(pool: asyncpg.Pool) -> dict[UUID, list[asyncpg.Record]]:
    all_events = await histories(pool)
    for task_id, events in all_events.items():
        check_history(task_id, events)
    return all_events


def max_overlap(intervals: Iterable[tuple[datetime, datetime]]) -> int:
    """The most intervals open at any one instant (an end and a start at the same instant
    count as not overlapping)."""
    points = []
    for start, end in intervals:
        points.append((start, 1))
        points.append((end, -1))
    points.sort(key=lambda p: (p[0], p[1]))
    best = now = 0
    for _, delta in points:
        now += delta
        best = max(best, now)
    return best
