"""An in-memory store for unit tests: the parts of shared.store.Store that services use, every
move through the same `fsm.plan` and the same CAS, lease and event rules as sql/tasks.sql."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

from shared import fsm
from shared.degrade import DegradeState, Mode
from shared.fsm import Move, State
from shared.models import Task, TaskSpec
from shared.store import NodeRow, Placing
from shared.store.tasks import Moved

_ENDS = frozenset(fsm.ALWAYS_TERMINAL | fsm.RETRYABLE)


def _now() -> datetime:
    return datetime.now(UTC)


def new_task(spec: TaskSpec, task_id: UUID | None = None, **fields: Any) -> Task:
    """A task as a fresh insert would store it (in Created unless `status` says otherwise)."""
    now = _now()
    values: dict[str, Any] = {
        "id": task_id or uuid4(),
        "name": spec.name,
        "kind": spec.job.kind,
        "spec_json": spec.model_dump_json(),
        "status": State.CREATED,
        "status_reason": "submitted",
        "version": 1,
        "attempt": 0,
        "priority": spec.priority,
        "retry_count": 0,
        "max_retries": spec.max_retries,
        "max_launch_failures": spec.max_launch_failures,
        "next_retry_at": None,
        "timeout_s": spec.timeout_s,
        "heartbeat_timeout_s": spec.heartbeat_timeout_s,
        "node": None,
        "idempotency_key": spec.idempotency_key,
        "paused_by": None,
        "paused_reason": None,
        "paused_at": None,
        "result": None,
        "error": None,
        "created_at": now,
        "updated_at": now,
        "queued_at": None,
        "started_at": None,
        "finished_at": None,
        "log_tail": None,
        "cpu": spec.resources.cpu,
        "memory_mb": spec.resources.memory_mb,
        "gpu": spec.resources.gpu,
        "traceparent": None,
        "hb_at": None,
        "hb_deadline": None,
        "hb_seq": 0,
        "workflow_id": None,
        "wf_task": None,
        "uses": [],
        "schedule_timeout_s": spec.schedule_timeout_s,
    }
    values.update(fields)
    return Task(**values)


@dataclass
class _Data:
    tasks: dict[UUID, Task] = field(default_factory=dict)
    events: list[tuple[UUID, State | None, State, int, str]] = field(default_factory=list)
    nodes: dict[str, NodeRow] = field(default_factory=dict)
    late: list[tuple[UUID, int, bool, Any, str | None, str]] = field(default_factory=list)
    resources: dict[tuple[UUID, str], int] = field(default_factory=dict)  # capacities
    wait_reasons: dict[UUID, str] = field(default_factory=dict)
    degrade: DegradeState = field(
        default_factory=lambda: DegradeState(Mode.NORMAL, False, "", "", _now(), None, 1)
    )


class FakeTasks:
    def __init__(self, data: _Data, margin_s: float) -> None:
        self.d = data
        self.margin = timedelta(seconds=margin_s)

    def _lease_over(self, task: Task) -> bool:
        return task.lease_until is None or task.lease_until + self.margin < _now()

    def _apply(self, task: Task, move: Move) -> Task:
        """sql/tasks.sql's `transition`, in Python."""
        p, now, to = move.patch, _now(), move.target
        ends_lease = move.source is State.RUNNING and to not in (State.PAUSED, State.CANCELED)
        changes: dict[str, Any] = {
            k: v
            for k, v in p.items()
            if k in {"attempt", "retry_count", "node", "result", "launch_failures"}
        }
        changes.update({k: p[k] for k in ("error", "log_tail", "inputs") if k in p})
        changes.update({k: p[k] for k in ("paused_by", "paused_reason") if k in p})
        if "retry_in_s" in p:
            changes["next_retry_at"] = now + timedelta(seconds=p["retry_in_s"])
        if to is State.PAUSED:
            changes["paused_at"] = now
        if to is State.READY and move.source not in fsm.HOLDS_SLOT:
            changes["queued_at"] = now  # back from a slot unstarted: its place in line kept
            if task.schedule_timeout_s is not None:
                changes["schedule_deadline"] = now + timedelta(seconds=task.schedule_timeout_s)
        if to is State.RUNNING:
            lease = timedelta(seconds=task.heartbeat_timeout_s)
            changes |= {
                "started_at": now,
                "hb_at": now,
                "hb_seq": 0,
                "hb_deadline": now + lease + self.margin,
                "lease_owner": UUID(p["lease_owner"]) if p.get("lease_owner") else None,
                "lease_attempt": task.attempt,
                "lease_until": now + lease,
            }
        elif ends_lease:
            changes |= {"lease_owner": None, "lease_attempt": None, "lease_until": None}
        if to in _ENDS:
            changes["finished_at"] = now
        moved = replace(
            task,
            status=to,
            status_reason=move.reason,
            version=task.version + 1,
            updated_at=now,
            **changes,
        )
        self.d.events.append((task.id, move.source, to, moved.version, move.reason))
        return moved

    async def transition_many(self, moves: Sequence[Move]) -> Moved:
        ids = [m.task_id for m in moves]
        if len(set(ids)) != len(ids):
            raise ValueError("a batch may move each task only once")
        out, won = Moved(), set()
        rows: dict[UUID, dict[str, Any]] = {}
        for move in moves:
            task = self.d.tasks.get(move.task_id)
            if task is None or (task.version, task.status) != (move.version, move.source):
                continue
            holder = move.target is State.LOST and str(task.lease_owner) == str(
                move.patch.get("lease_owner")
            )
            if move.target in (State.LOST, State.RUNNING) and not (
                self._lease_over(task) or holder
            ):
                continue
            self.d.tasks[task.id] = moved = self._apply(task, move)
            won.add(task.id)
            # as the store returns them: whole where read back, else what a move decides
            row = dict(moved.__dict__) if move.read_back else {}
            row.update(id=moved.id, status=moved.status.value, version=moved.version)
            row.update(attempt=moved.attempt, node=moved.node)
            rows[task.id] = row
            if move.read_back:
                out.append(moved)
        out.ids = frozenset(won)
        out.rows = rows
        return out

    async def transition(self, move: Move) -> Task | None:
        moved = await self.transition_many([move])
        return moved[0] if moved else None

    async def admit_many(
        self,
        specs: Sequence[TaskSpec],
        ids: Sequence[UUID],
        walk: Sequence[State],
        traceparents: Sequence[str | None] | None = None,
        placing: Placing | None = None,
    ) -> list[tuple[Task, bool]]:
        out = []
        for spec, task_id in zip(specs, ids, strict=True):
            found = self.d.tasks.get(task_id)
            if found is not None:
                out.append((found, False))
                continue
            task = self.d.tasks[task_id] = new_task(spec, task_id)
            for target in walk:
                task = self.d.tasks[task_id] = self._apply(task, fsm.plan(task, target))
            out.append((task, True))
        if placing is not None:
            created = {t.id for t, new in out if new}
            await self._place_checked([m for m in placing.moves if m.task_id in created], placing)
            out = [(self.d.tasks[t.id] if new else t, new) for t, new in out]
        return out

    async def _place_checked(self, moves: Sequence[Move], placing: Placing) -> None:
        """sked_admit's check, in memory: a planned node takes its tasks only if it is live,
        ready, uncordoned, of the boot id planned on, and has room for all of them."""
        if self.d.degrade.effective() is not Mode.NORMAL:
            return
        nodes = {n.id: n for n in await FakeNodes(self.d).all()}
        by_node: dict[str, list[Move]] = {}
        for move in moves:
            by_node.setdefault(str(move.patch["node"]), []).append(move)
        for node_id, some in by_node.items():
            node = nodes.get(node_id)
            if node is None or node.boot_id != placing.boot_ids.get(node_id):
                continue
            if not (node.ready and node.live and node.cordoned_at is None):
                continue
            want = [self.d.tasks[m.task_id] for m in some]
            if (
                node.used_slots + len(want) <= node.slots + node.prefetch
                and node.used_cpu + sum(t.cpu for t in want) <= node.cpu + 1e-9
                and node.used_memory_mb + sum(t.memory_mb for t in want) <= node.memory_mb
                and node.used_gpu + sum(t.gpu for t in want) <= node.gpu
            ):
                await self.transition_many(some)

    async def get(self, task_id: UUID) -> Task:
        return self.d.tasks[task_id]

    async def get_many(self, ids: Iterable[UUID]) -> list[Task]:
        return [self.d.tasks[i] for i in ids if i in self.d.tasks]

    async def get_ready(self, ids: Sequence[UUID]) -> tuple[list[Task], list[Task]]:
        ready = [t for t in await self.get_many(ids) if t.status is State.READY]
        return [t for t in ready if self._lease_over(t)], [
            t for t in ready if not self._lease_over(t)
        ]

    async def set_wait_reasons(self, reasons: Mapping[UUID, str]) -> None:
        self.d.wait_reasons.update(reasons)

    def _with_deadline(self) -> list[Task]:
        waiting = [
            t
            for t in self.d.tasks.values()
            if t.status in fsm.AWAITS_START and t.schedule_deadline is not None
        ]
        return sorted(waiting, key=lambda t: t.schedule_deadline or _now())

    async def next_schedule_deadline(self) -> float | None:
        first = next(iter(self._with_deadline()), None)
        if first is None or first.schedule_deadline is None:
            return None
        return (first.schedule_deadline - _now()).total_seconds()

    async def still_placed(self, attempts: Sequence[tuple[UUID, int, str]]) -> set[UUID]:
        return {
            i
            for i, attempt, node in attempts
            if (t := self.d.tasks.get(i)) is not None
            and (t.status, t.attempt, t.node) == (State.SCHEDULING, attempt, node)
        }

    async def ended_with(self, attempts: Sequence[tuple[UUID, int]], reason: str) -> set[UUID]:
        wanted = {(i, v + 1) for i, v in attempts}
        return {
            i
            for i, src, _, v, why in self.d.events
            if (i, v) in wanted and src is State.RUNNING and why.startswith(reason)
        }


class FakeClaims:
    def __init__(self, tasks: FakeTasks) -> None:
        self.tasks = tasks

    async def fail_unstarted(self, limit: int, plan: Callable[[Task], Move]) -> list[Task]:
        now = _now()
        due = [
            t
            for t in self.tasks._with_deadline()
            if t.schedule_deadline and t.schedule_deadline <= now
        ]
        return await self.tasks.transition_many([plan(t) for t in due[:limit]])


class FakeLeases:
    def __init__(self, data: _Data) -> None:
        self.d = data
        self.grace_given: list[tuple[UUID, int]] = []
        self.restored: list[tuple[UUID, int]] = []

    async def release(self, owner: UUID, attempts: Sequence[tuple[UUID, int]]) -> None:
        for task_id, attempt in attempts:
            t = self.d.tasks.get(task_id)
            if t is None or (t.lease_owner, t.lease_attempt) != (owner, attempt):
                continue
            if not (t.status is State.RUNNING and t.attempt == attempt):
                self.d.tasks[task_id] = replace(
                    t, lease_owner=None, lease_attempt=None, lease_until=None
                )

    async def grace(self, task_id: UUID, attempt: int) -> None:
        self.grace_given.append((task_id, attempt))

    async def restore(self, task_id: UUID, attempt: int) -> None:
        self.restored.append((task_id, attempt))


class FakeNodes:
    def __init__(self, data: _Data) -> None:
        self.d = data

    def add(self, node_id: str, slots: int = 4, cpu: float = 4.0, gpu: int = 0, **kw: Any) -> None:
        now = _now()
        self.d.nodes[node_id] = NodeRow(
            id=node_id,
            slots=slots,
            cpu=cpu,
            memory_mb=kw.pop("memory_mb", 8192),
            gpu=gpu,
            labels=kw.pop("labels", {}),
            ready=kw.pop("ready", True),
            live=kw.pop("live", True),
            load=0.0,
            boot_id=uuid4(),
            registered_at=now,
            heartbeat_at=now,
            used_slots=0,
            used_cpu=0.0,
            used_memory_mb=0,
            used_gpu=0,
        )

    async def all(self) -> list[NodeRow]:
        """Every node with its usage: the attempts holding it, as the SQL sums them."""
        out = []
        for node in sorted(self.d.nodes.values(), key=lambda n: n.id):
            held = [
                t for t in self.d.tasks.values() if t.node == node.id and t.status in fsm.HOLDS_SLOT
            ]
            out.append(
                replace(
                    node,
                    used_slots=len(held),
                    used_cpu=sum(t.cpu for t in held),
                    used_memory_mb=sum(t.memory_mb for t in held),
                    used_gpu=sum(t.gpu for t in held),
                )
            )
        return out

    async def lock_and_read(self) -> tuple[list[NodeRow], Mode | None]:
        nodes = await self.all()
        return nodes, self.d.degrade.effective() if nodes else None

    async def read(self) -> tuple[list[NodeRow], Mode | None]:
        return await self.lock_and_read()

    async def set_ready(self, node_id: str, boot_id: UUID, ready: bool) -> None:
        node = self.d.nodes[node_id]
        if node.boot_id == boot_id:
            self.d.nodes[node_id] = replace(node, ready=ready)


class FakeWorkflows:
    def __init__(self, data: _Data) -> None:
        self.d = data

    async def lock(self, workflow_ids: Sequence[UUID]) -> None:
        """One process, one event loop: nothing to wait for."""

    async def resources_held(
        self, workflow_ids: Sequence[UUID]
    ) -> dict[tuple[UUID, str], tuple[int, int]]:
        out = {}
        for (wf, name), capacity in self.d.resources.items():
            if wf in workflow_ids:
                held = sum(
                    1
                    for t in self.d.tasks.values()
                    if t.workflow_id == wf and t.status in fsm.HOLDS_SLOT and name in t.uses
                )
                out[(wf, name)] = (held, capacity)
        return out


class FakeLate:
    def __init__(self, data: _Data) -> None:
        self.d = data

    async def record(self, results: Sequence[tuple[UUID, int, bool, Any, str | None, str]]) -> None:
        # one per (task, attempt), as late_results' unique index keeps them (0021)
        seen = {(r[0], r[1]) for r in self.d.late}
        for r in results:
            if (r[0], r[1]) not in seen:
                seen.add((r[0], r[1]))
                self.d.late.append(r)


class FakeDegrade:
    """The degrade row (shared/store/degrade.py): a mode set here has no end unless given
    `remaining_s` (the fake has no clock of Postgres's to count it on)."""

    def __init__(self, data: _Data) -> None:
        self.d = data

    async def read(self) -> DegradeState:
        return self.d.degrade

    async def set(
        self,
        mode: Mode,
        reason: str,
        set_by: str,
        for_s: float | None,
        version: int,
        automatic: bool = False,
    ) -> DegradeState | None:
        if version != self.d.degrade.version:
            return None
        now = _now()
        until = None if for_s is None else now + timedelta(seconds=for_s)
        self.d.degrade = DegradeState(
            mode, automatic, reason, set_by, now, until, version + 1, for_s
        )
        return self.d.degrade

    async def ready_at_least(
        self, priority: int, limit: int, after: tuple[int, datetime, UUID] | None = None
    ) -> list[tuple[int, datetime, UUID]]:
        ready = [
            (t.priority, t.queued_at or _now(), t.id)
            for t in self.d.tasks.values()
            if t.status is State.READY and t.priority >= priority
        ]
        ready.sort(key=lambda r: (-r[0], r[1], r[2]))
        if after is not None:
            mark = (-after[0], after[1], after[2])
            ready = [r for r in ready if (-r[0], r[1], r[2]) > mark]
        return ready[:limit]


class InMemoryStore:
    """The parts of shared.store.Store that services use, in memory. `transaction()` is all
    or nothing: an exception inside it restores what was there before."""

    def __init__(self, lease_margin_s: float = 0.5, node_ttl_s: float = 10.0) -> None:
        self.lease_margin_s = lease_margin_s
        self.node_ttl_s = node_ttl_s
        self.data = _Data()
        self.tasks = FakeTasks(self.data, lease_margin_s)
        self.claims = FakeClaims(self.tasks)
        self.leases = FakeLeases(self.data)
        self.nodes = FakeNodes(self.data)
        self.workflows = FakeWorkflows(self.data)
        self.late = FakeLate(self.data)
        self.degrade = FakeDegrade(self.data)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[InMemoryStore]:
        before = (dict(self.data.tasks), list(self.data.events), list(self.data.late))
        try:
            yield self
        except BaseException:
            self.data.tasks, self.data.events, self.data.late = (
                before[0],
                before[1],
                before[2],
            )
            for part in (self.tasks, self.leases, self.nodes, self.workflows, self.late):
                part.d = self.data
            self.degrade.d = self.data
            raise

    def put(self, task: Task) -> Task:
        self.data.tasks[task.id] = task
        return task

    async def walk(self, task: Task, *targets: State, **changes: Any) -> Task:
        """Move `task` through `targets` (the changes go with the last move)."""
        for i, target in enumerate(targets):
            extra = changes if i == len(targets) - 1 else {}
            moved = await self.tasks.transition(fsm.plan(task, target, **extra))
            assert moved is not None, f"{task.status.label} -> {target.label} lost"
            task = moved
        return task
