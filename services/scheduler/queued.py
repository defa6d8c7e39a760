"""The tasks this scheduler put in line, as it put them there, so that a dispatch pass popping
one of them need not read its row again (`get_ready`: a statement and a whole row decoded per
task, ~20 µs of a burst's task, docs/performance.md).

Only a task that never had an attempt is kept: no lease of an earlier attempt can fence it.
And a kept task is used only if the queue entry popped is the one this scheduler pushed —
the same score, so the same priority and time in line: a task pushed again by anyone since
(resumed, reprioritised, retried) comes back with another score and is read afresh. Whatever
else happened to it meanwhile (paused, canceled, placed by another scheduler) changed its
version, so the placement's CAS refuses the kept copy, and the pass reads the task again and
puts it back in line if it is still Ready (`Dispatcher.dispatch_once`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from uuid import UUID

from shared.fsm import State
from shared.models import Task

KEEP = 10_000  # tasks kept at most (a Task is ~3 KB)
KEEP_S = 60.0  # what was kept longer is dropped to make room: another scheduler popped it


class QueuedTasks:
    def __init__(self) -> None:
        self._kept: dict[UUID, tuple[Task, float, float]] = {}  # id -> task, score, kept at
        self._swept_at = 0.0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, tasks: Iterable[tuple[Task, float]]) -> None:
        """These tasks were pushed into the ready queue with these scores."""
        kept, now = self._kept, time.monotonic()
        for task, score in tasks:
            if task.attempt or task.lease_attempt is not None or task.status is not State.READY:
                continue
            if len(kept) >= KEEP and not self._make_room(now):
                return  # full of what will be popped sooner
            kept[task.id] = (task, score, now)

    def take(self, popped: Sequence[tuple[UUID, float]]) -> tuple[list[Task], list[UUID]]:
        """Of the queue entries popped: the tasks kept for exactly those entries, and the ids
        of the rest, to be read from Postgres."""
        known, unknown = [], []
        for task_id, score in popped:
            entry = self._kept.pop(task_id, None)
            if entry is not None and entry[1] == score:
                known.append(entry[0])
            else:
                unknown.append(task_id)
        return known, unknown

    def _make_room(self, now: float) -> bool:
        if now - self._swept_at < 1.0:
            return False  # swept a moment ago: what is kept is what will be popped next
        self._swept_at = now
        stale = [i for i, (_, _, at) in self._kept.items() if now - at > KEEP_S]
        for task_id in stale:
            del self._kept[task_id]
        return len(self._kept) < KEEP
