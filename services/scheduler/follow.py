"""Dispatch messages that follow a placement's notification, only where it was not enough.

An admission that places its tasks at once tells each node of them by its commit
(`sked_admit`'s NOTIFY on the node's channel), and the node's executor claims them from there
within milliseconds. The dispatch message is then only a second copy the executor settles
unclaimed: at 100 tasks/s it was 6-13 % of a task's CPU over the stack (the scheduler's publish
and confirm, RabbitMQ's persistence and delivery, the executor's wake-up) and a fifth to a
quarter of its submit -> start p50 on a slow host (docs/performance.md, 2026-12-06). So those
messages wait `SKED_DISPATCH_FOLLOW_S` and go out only for the attempts still Scheduling then
(one statement for all that came due): a notification missed (the executor's LISTEN
reconnecting, its process restarting, a cluster's executor, which takes dispatches by message
only) or an attempt held in a full node's backlog. Durability is unchanged — the placement is
committed before anything is told, and an attempt whose notification and message were both lost
(the node missed the NOTIFY and this scheduler died within the wait) goes back to Ready by the
stuck-in-Scheduling sweep, as an attempt whose message was lost always has.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence

from shared.dispatches import MAX_PLACED
from shared.models import Task
from shared.resilience import TRANSIENT
from shared.runtime import wait_any
from shared.store import Store

log = logging.getLogger(__name__)

Sender = Callable[[list[Task]], Awaitable[None]]  # Dispatcher.send


class Follower:
    """Holds the placements whose nodes were told by the commit, and sends the dispatch
    messages of those still unclaimed `wait_s` later (`run`), or at once when stopping."""

    def __init__(self, store: Store, wait_s: float, send: Sender) -> None:
        self.store = store
        self.wait_s = wait_s
        self.send = send
        self._due: deque[tuple[float, list[Task]]] = deque()  # (monotonic due time, tasks)
        self._added = asyncio.Event()

    def __len__(self) -> int:
        return sum(len(tasks) for _, tasks in self._due)

    def hold(self, moved: list[Task]) -> list[Task]:
        """An admission's placements: those its commit told their nodes of are held, their
        dispatch messages sent later if still needed then; returns the rest, to send now (all
        of them without a wait)."""
        if self.wait_s <= 0:
            return moved
        notified, rest = told(moved, MAX_PLACED)
        if notified:
            self._due.append((time.monotonic() + self.wait_s, notified))
            self._added.set()
        return rest

    async def run(self, stopping: asyncio.Event) -> None:
        """Until stopping: send what came due. Then whatever still waits, at once."""
        while not stopping.is_set():
            self._added.clear()
            if not self._due:
                await wait_any(self._added, stopping)
                continue
            left = self._due[0][0] - time.monotonic()
            if left > 0:
                await wait_any(stopping, timeout=left)
                continue
            # with those due within half the wait: one statement every half-wait at most, not
            # one per admission (at 100 tasks/s that read was a statement a task)
            await self.send_due(time.monotonic() + self.wait_s / 2)
        await self.send_due(None)

    async def send_due(self, now: float | None) -> int:
        """Send the dispatch messages of the placements due by `now` (None: all) whose tasks
        are still Scheduling in the attempt placed, on the node placed; returns how many. If
        Postgres is away they are kept, due at once, for the next call (the supervisor
        restarts the loop); once read, they are sent, or taken back to Ready by `send`."""
        due: list[Task] = []
        while self._due and (now is None or self._due[0][0] <= now):
            due += self._due.popleft()[1]
        if not due:
            return 0
        try:
            unclaimed = await self.store.tasks.still_placed(
                [(t.id, t.attempt, t.node or "") for t in due]
            )
        except TRANSIENT:
            self._due.appendleft((0.0, due))
            raise
        waiting = [t for t in due if t.id in unclaimed]
        if waiting:
            # debug: under load a full node's backlog holds some every half-wait
            log.debug("%d placements not claimed from their notification: dispatched", len(waiting))
            await self.send(waiting)
        return len(waiting)


def told(moved: Sequence[Task], most: int) -> tuple[list[Task], list[Task]]:
    """An admission's placements split in two: those its commit told their nodes of — a
    node's, if it took at most `most` (sked_admit notifies a node of that many in one
    payload) — and the rest, whose nodes learn of them by the dispatch message alone."""
    per_node = Counter(t.node for t in moved)
    notified = [t for t in moved if per_node[t.node] <= most]
    return notified, [t for t in moved if per_node[t.node] > most]
