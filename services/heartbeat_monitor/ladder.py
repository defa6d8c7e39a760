"""The loss-confirmation ladder for an overdue attempt (the decision is shared.heartbeat's
`next_rung`): ask its executor, then restore, reconcile, give a grace, or declare it Lost —
each rung taken named in the event's reason."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Protocol

from pydantic import ValidationError

from shared import fsm, heartbeat
from shared.bus import PROBE_EXCHANGE, UNROUTABLE
from shared.fsm import State
from shared.heartbeat import Evidence, ProbeAnswer, Rung, next_rung
from shared.models import Task
from shared.outcome import end_move, retries
from shared.store import NodeRow, Store

log = logging.getLogger(__name__)


class Unreachable:
    """No executor of the node is connected: its probe queue is gone with its connection."""


UNREACHABLE = Unreachable()


class Requests(Protocol):
    """The bus's request/reply (shared.bus.AmqpBus.request)."""

    async def request(
        self, exchange: str, routing_key: str, body: bytes, timeout: float
    ) -> object: ...


class Ladder:
    def __init__(self, store: Store, bus: Requests, probe_timeout_s: float) -> None:
        self.store = store
        self.bus = bus
        self.probe_timeout_s = probe_timeout_s
        self.rungs: dict[tuple[uuid.UUID, int], list[str]] = {}

    async def sweep(self, overdue: list[tuple[Task, float]]) -> int:
        """One rung for each overdue attempt (with the seconds since its lease was renewed);
        the verdicts of the sweep are written together."""
        if not overdue:
            return 0
        nodes = {n.id: n for n in await self.store.nodes.all()}
        verdicts = await asyncio.gather(*(self.climb(t, silent, nodes) for t, silent in overdue))
        await self.apply([move for _, move in verdicts if move is not None])
        return len(overdue)

    async def climb(
        self, task: Task, silent_s: float, nodes: dict[str, NodeRow]
    ) -> tuple[Rung, fsm.Move | None]:
        """One rung of the ladder for one overdue attempt; the move it decides (Lost, or the
        backend's outcome) is returned for the sweep to apply with the others in one go.
        `silent_s`: seconds since its lease was last renewed, by Postgres's clock."""
        timeout = task.heartbeat_timeout_s
        node = nodes.get(task.node or "")
        key = (task.id, task.attempt)
        rungs = self.rungs.setdefault(
            key, [f"lease not renewed for {silent_s:.1f} s (timeout {timeout:g} s)"]
        )
        answer: ProbeAnswer | Unreachable | None = UNREACHABLE
        move: fsm.Move | None = None
        if node is not None and node.ready and node.live:
            answer = await self.probe(task)
            if answer is UNREACHABLE:
                # its row still looks fresh, but no executor of it is connected: take it out
                # of placement now rather than when its row goes stale (it re-asserts itself
                # on its next heartbeat if it was only reconnecting)
                await self.store.nodes.set_ready(node.id, node.boot_id, False)
                log.warning("node %s has no executor connected: marked not ready", node.id)
        alive = answer is not UNREACHABLE
        said = answer.state if isinstance(answer, ProbeAnswer) else None
        if said == "finished" and isinstance(answer, ProbeAnswer) and answer.report is None:
            said = "unknown"  # "finished" without an outcome reconciles nothing
        if said == "frozen":
            rungs.append("backend: frozen by its watchdog")
            said = None  # as good as no answer: the node is alive but cannot renew
        rung = next_rung(Evidence(silent_s - timeout, timeout, alive, said))
        if rung is Rung.GRACE:
            rungs.append(f"node {task.node} ready: grace to {2 * timeout:g} s")
            await self.store.leases.grace(task.id, task.attempt)
        elif rung is Rung.RESTORE:
            rungs.append("backend reports it running: deadline restored")
            log.warning("%s attempt %d: %s", task.id, task.attempt, "; ".join(rungs))
            await self.store.leases.restore(task.id, task.attempt)
        elif rung is Rung.RECONCILE:
            assert isinstance(answer, ProbeAnswer)
            assert answer.report is not None
            rungs.append("backend reports it finished: reconciled to its outcome")
            move = end_move(task, answer.report, "; ".join(rungs))
        else:
            if not alive:
                rungs.append(f"node {task.node} gone (no executor connected, or not ready)")
            elif said is None:
                rungs.append("grace spent; backend: no answer")
            else:
                rungs.append(f"backend: attempt {said}")
            move = fsm.plan(task, State.LOST, "; ".join(rungs))
        if rung is not Rung.GRACE:
            self.rungs.pop(key, None)
        return rung, move

    async def apply(self, moves: list[fsm.Move]) -> None:
        """The ladder's verdicts of one sweep, as one transaction (with the retries the
        reconciled failures earn); a lost CAS (the task moved on) is fine."""
        if not moves:
            return
        async with self.store.transaction() as tx:
            # a Lost whose lease was renewed meanwhile loses its CAS: the lease rules
            moved = await tx.tasks.transition_many(moves)
            await tx.tasks.transition_many(retries(moved))
        reasons = {m.task_id: m.reason for m in moves}
        for task in moved:
            log.warning(
                "%s attempt %d -> %s: %s",
                task.id,
                task.attempt,
                task.status.label,
                reasons[task.id],
                extra={"task_id": str(task.id), "attempt": task.attempt},
            )

    async def probe(self, task: Task) -> ProbeAnswer | Unreachable | None:
        """Ask the task's executor about the attempt: its answer; UNREACHABLE if no executor
        of that node is connected (the request comes straight back); None if it is connected
        but gives no readable answer within the probe timeout."""
        if task.node is None:
            return UNREACHABLE
        body = heartbeat.Probe(task_id=task.id, attempt=task.attempt).model_dump_json().encode()
        got = await self.bus.request(PROBE_EXCHANGE, task.node, body, self.probe_timeout_s)
        if got is UNROUTABLE:
            return UNREACHABLE
        if not isinstance(got, bytes):
            return None
        try:
            return ProbeAnswer.model_validate_json(got)
        except ValidationError as exc:  # an answer that cannot be read is no answer
            log.warning("unreadable probe answer ignored: %s", exc)
            return None
