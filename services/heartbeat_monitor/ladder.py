"""The loss-confirmation ladder for an overdue attempt (the decision is shared.heartbeat's
`next_rung`): ask its executor, then restore, reconcile, give a grace, or declare it Lost —
each rung taken named in the event's reason."""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import datetime
from typing import Protocol

from shared import fsm, heartbeat
from shared.bus import PROBE_EXCHANGE, UNROUTABLE
from shared.bus_rpc import Accept
from shared.errors import one_line
from shared.fsm import State
from shared.heartbeat import Evidence, ProbeAnswer, Rung, next_rung
from shared.models import Task
from shared.outcome import end_move, retries
from shared.store import NodeRow, Store
from shared.throttle import Throttled

log = logging.getLogger(__name__)


class Unreachable:
    """No executor of the node is connected: its probe queue is gone with its connection."""


UNREACHABLE = Unreachable()


class Requests(Protocol):
    """The bus's request/reply (shared.bus.AmqpBus.request)."""

    async def request(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        timeout: float,
        correlation_id: str | None = None,
        accept: Accept | None = None,
    ) -> object: ...


# The silence an attempt's rungs speak of: they are remembered between sweeps only while
# it lasts. A renewal (lease_until) or a beat (hb_seq) ends it; a next silence is judged anew.
Episode = tuple[datetime | None, int]


def episode(task: Task) -> Episode:
    return task.lease_until, task.hb_seq


class Ladder:
    def __init__(self, store: Store, bus: Requests, probe_timeout_s: float, secret: str) -> None:
        self.store = store
        self.bus = bus
        self.probe_timeout_s = probe_timeout_s
        self.secret = secret  # SKED_HEARTBEAT_SECRET: an executor's answers are signed with it
        # (task, attempt) -> the silence episode and the rungs taken in it so far: only those
        # in a grace, dropped by the next sweep once the episode is over (`forget`)
        self.rungs: dict[tuple[uuid.UUID, int], tuple[Episode, list[str]]] = {}
        self.refused = 0  # probe answers not believed (unsigned, a wrong MAC, another attempt)
        self._refused = Throttled(log)  # anyone on the bus can send them: no log flood

    async def sweep(self, overdue: list[tuple[Task, float]]) -> int:
        """One rung for each overdue attempt (with the seconds since its lease was renewed).
        The verdicts that need no probe (no executor of its node can answer) are written
        first, together; then those of the probes, each bounded by the probe timeout."""
        await self.forget({t.id for t, _ in overdue})
        if not overdue:
            return 0
        nodes = {n.id: n for n in await self.store.nodes.all()}
        asked = [(t, s) for t, s in overdue if self.askable(t, nodes)]
        unasked = [(t, s) for t, s in overdue if not self.askable(t, nodes)]
        for batch in (unasked, asked):
            verdicts = await asyncio.gather(*(self.climb(t, s, nodes) for t, s in batch))
            await self.apply([move for _, move in verdicts if move is not None])
        return len(overdue)

    async def forget(self, judging: set[uuid.UUID]) -> None:
        """Drop the rungs of attempts whose silence is over — ended, judged by another replica,
        renewed or beating again — save those this sweep is about to judge."""
        kept = [key for key in self.rungs if key[0] not in judging]
        if not kept:
            return
        now = {t.id: t for t in await self.store.tasks.get_many([key[0] for key in kept])}
        for key in kept:
            task = now.get(key[0])
            if (
                task is None
                or task.status is not State.RUNNING
                or task.attempt != key[1]
                or episode(task) != self.rungs[key][0]
            ):
                del self.rungs[key]

    @staticmethod
    def askable(task: Task, nodes: dict[str, NodeRow]) -> bool:
        """Whether the attempt's node may have an executor to probe: its row ready and live."""
        node = nodes.get(task.node or "")
        return node is not None and node.ready and node.live

    async def climb(
        self, task: Task, silent_s: float, nodes: dict[str, NodeRow]
    ) -> tuple[Rung, fsm.Move | None]:
        """One rung of the ladder for one overdue attempt; the move it decides (Lost, or the
        backend's outcome) is returned for the sweep to apply with the others in one go.
        `silent_s`: seconds since its lease was last renewed, by Postgres's clock."""
        timeout = task.heartbeat_timeout_s
        node = nodes.get(task.node or "")
        key = (task.id, task.attempt)
        remembered = self.rungs.get(key)
        rungs = remembered[1] if remembered and remembered[0] == episode(task) else [""]
        # first, always: the silence judged now, this episode's
        rungs[0] = f"lease not renewed for {silent_s:.1f} s (timeout {timeout:g} s)"
        answer: ProbeAnswer | Unreachable | None = UNREACHABLE
        move: fsm.Move | None = None
        if node is not None and self.askable(task, nodes):
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
        if said == "running" and silent_s >= timeout:
            # its lease lapsed (by Postgres's clock), so its watchdog stops it: restoring the
            # deadline would keep an attempt nobody renews Running on its word alone
            rungs.append("backend: running, but its lease lapsed")
            said = None  # as frozen: a grace, then Lost
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
        if rung is Rung.GRACE:
            self.rungs[key] = (episode(task), rungs)
        else:
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
        but gives no answer it signed for this probe within the probe timeout (an answer that
        is not is counted, and waited past: the executor's may still come)."""
        if task.node is None:
            return UNREACHABLE
        probe = heartbeat.Probe(task_id=task.id, attempt=task.attempt)
        correlation = uuid.uuid4().hex

        def believed(body: bytes) -> ProbeAnswer | None:
            try:
                return heartbeat.believe(self.secret, correlation, probe, body)
            except ValueError as exc:
                self.refused += 1
                self._refused.warning(
                    "probe answer for %s attempt %d not believed: %s",
                    task.id,
                    task.attempt,
                    one_line(exc)[:300],
                )
                return None

        got = await self.bus.request(
            PROBE_EXCHANGE,
            task.node,
            probe.model_dump_json().encode(),
            self.probe_timeout_s,
            correlation_id=correlation,
            accept=lambda body: believed(body) is not None,
        )
        if got is UNROUTABLE:
            return UNREACHABLE
        # taken by `accept` already; read again (a cheap HMAC) rather than trust the bus to
        # have applied it
        return believed(got) if isinstance(got, bytes) else None
