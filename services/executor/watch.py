"""Watching the attempts that run here: renewing their leases every period, and stopping those
whose task moved on — paused or canceled by an operator, declared lost and retried elsewhere."""

from __future__ import annotations

import logging
import time

from services.executor.node import Node
from shared import fsm, lease
from shared.errors import one_line
from shared.fsm import State
from shared.resilience import TRANSIENT, backoff_s
from shared.runtime import wait_any
from shared.store import may_name, parse_notify

log = logging.getLogger(__name__)

# A move into one of these, made by someone else, takes a running attempt away from this node.
TAKEN_AWAY = {s.value for s in fsm.TAKES_AWAY}


class Watcher:
    def __init__(self, node: Node) -> None:
        self.node = node
        self._leases = node.store.lease_link()

    def close(self) -> None:
        self._leases.close()

    async def renew_loop(self) -> None:
        """Renew every attempt's lease each period, whatever happens: a failure is logged and
        the next period tries again (the watchdog freezes what is not renewed in time). It
        runs on through a stopping executor's drain: what the drain lets finish needs it."""
        node = self.node
        while not node.drained.is_set():
            period = lease.renew_every_s(
                node.settings.node_heartbeat_s,
                [a.task.heartbeat_timeout_s for a in node.active.values()],
            )
            if await wait_any(node.drained, timeout=period):
                return
            try:
                await self.renew_once(timeout=period, connecting=self._time_left())
            except Exception as exc:  # the next period tries again; the watchdog covers a gap
                log.warning("lease renewal failed: %s", one_line(exc))

    def _time_left(self) -> float:
        """What is left of the shortest lease held here: a renewal that connects afresh may
        take that long, one on a connection made before half of it (LeaseLink.renew). Bound
        by the period, a link slower than that (0.3 s each way: a connection is five round
        trips) dropped every renewal and connected afresh within the same bound, for ever,
        while the leases lapsed and every attempt here was declared Lost; bound by all of
        it, a connection gone silent held a renewal until the lease ended."""
        now = time.monotonic()
        return min(
            (
                lease.remaining_s(a.task.heartbeat_timeout_s, a.renewed_at, now)
                for a in self.node.active.values()
            ),
            default=0.0,
        )

    async def renew_once(self, timeout: float = 2.0, connecting: float | None = None) -> int:
        """One renewal of every lease held here; returns how many Postgres renewed.

        On a link of its own (store.LeaseLink), dropped on a timeout: a partition that swallows
        packets must not leave a renewal hanging while the watchdog's clock runs."""
        node = self.node
        keys = list(node.active)
        if not keys:
            return 0
        sent_at = time.monotonic()
        renewed, passed = await self._leases.renew(
            node.boot_id, keys, max(timeout, 0.5), connecting
        )
        now = time.monotonic()
        refused = set()
        for key in keys:
            attempt = node.active.get(key)
            if attempt is None:
                continue
            if key in renewed:
                attempt.renewed_at = sent_at
                left = lease.remaining_s(attempt.task.heartbeat_timeout_s, sent_at, now)
                if left > 0:  # one over already (sent before this process froze) thaws nothing
                    node.backend.renew(key, left)
            elif key not in passed:  # (a row held elsewhere: not renewed this time, still ours)
                # Postgres says it is not ours any more (paused, canceled, lost and retried):
                # the watch loop stops it, and its lease is given back once it is gone
                refused.add(key[0])
        if refused:
            node.suspect(refused)
        return len(renewed)

    def on_task_notify(self, _c: object, _p: int, _ch: str, payload: str) -> None:
        if not may_name(payload, TAKEN_AWAY):
            return  # most are moves to Scheduling, Running or an end: skipped unparsed
        notice = parse_notify(payload)
        if notice.states & TAKEN_AWAY:
            node = self.node
            node.suspect(None if notice.ids is None else set(notice.ids))
            if node.gated:  # and its backlog: those it holds may be among them
                if notice.ids is None or node.taken_ids is None:
                    node.taken_ids = None
                else:
                    node.taken_ids |= set(notice.ids)
                node.taken.set()

    async def watch_loop(self) -> None:
        """Stop attempts whose task is no longer Running in that attempt here. Woken by the
        NOTIFY of such a move and by a lease renewal Postgres refused (so a missed NOTIFY costs
        at most a renewal period). The attempt holds its slot until its process is gone, so this
        node never runs more processes than it has slots (the starter's gate, node.gated).
        It runs on through a stopping executor's drain (a cancel then still stops its attempt);
        a transient error there is retried here, as the supervisor restarts no loop by then."""
        node = self.node
        failures = 0
        while not node.drained.is_set():
            await wait_any(node.look, node.drained)
            node.look.clear()
            suspects, node.suspects = node.suspects, set()
            mine = [(i, a) for i, a in node.active if i in suspects]
            if not mine:
                continue
            try:
                found = await node.store.tasks.get_many([i for i, _ in mine])
            except TRANSIENT:
                node.suspect(suspects)  # looked at again
                if not node.stopping.is_set():
                    raise
                failures += 1
                await wait_any(node.drained, timeout=backoff_s(failures))
                continue
            current = {t.id: t for t in found}
            for task_id, attempt in mine:
                task = current.get(task_id)
                if task is None or (task.status is State.RUNNING and task.attempt == attempt):
                    continue
                why = "gone" if task is None else f"{task.status.label} (attempt {task.attempt})"
                if await node.backend.stop_task(task_id, attempt):
                    log.info(
                        "stopped %s attempt %d: the task is now %s",
                        task_id,
                        attempt,
                        why,
                        extra={"task_id": str(task_id), "attempt": attempt},
                    )
