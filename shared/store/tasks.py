"""Tasks: creation, the compare-and-swap that moves them, and reads.

A transition is one statement (`transition` in sql/tasks.sql): the CAS, the task_events row
(history and outbox at once) and one NOTIFY, so a state change and the event announcing it can
never diverge. A batch moves many tasks in that one statement (`unnest`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any
from uuid import UUID, uuid4

from shared import fsm, hooks
from shared.dag import effective_priorities
from shared.errors import InvalidSpec, NotAllowed, NotFound
from shared.fsm import Move, State
from shared.models import Event, Task, TaskSpec
from shared.store.db import Db, get_task, task, tasks_of
from shared.store.moves import move_args
from shared.store.queries import Q


@dataclass(frozen=True)
class QueuedRow:
    """What the ready queue needs to score a task."""

    id: UUID
    priority: int
    queued_at: datetime | None


class Moved(list[Task]):
    """The tasks one statement moved, in the order of its moves, as their rows after it —
    those whose moves asked for them back (fsm.Move.read_back); `ids` names every task it
    moved, those too whose rows were not read back, and `rows` holds each one's row as
    returned: where not read back, only its id, status, version, attempt and node."""

    ids: frozenset[UUID] = frozenset()
    rows: Mapping[UUID, Mapping[str, Any]] = MappingProxyType({})


# The levels a moved row comes back at (fragment task_columns_at): what the move decided (id,
# status, version, attempt, node), that and what a hook reads (hooks.SEEN), or all of it.
_DECIDED, _SEEN_BY_HOOKS, _WHOLE = 0, 1, 2


@dataclass(frozen=True)
class Placing:
    """Placements planned for tasks an admission is about to create (`Tasks.admit_many`):
    their moves Ready -> Scheduling (each naming its node), every node named with the boot
    id it was read with, and the TTL within which a node must have heartbeat to be live."""

    moves: Sequence[Move]
    boot_ids: Mapping[str, UUID]
    node_ttl_s: float


class Tasks:
    def __init__(self, db: Db) -> None:
        self.db = db

    # -- creation ---------------------------------------------------------------------------

    async def create(self, spec: TaskSpec, task_id: UUID | None = None) -> Task:
        return (await self.create_many([spec], None if task_id is None else [task_id]))[0]

    async def admit_many(
        self,
        specs: Sequence[TaskSpec],
        ids: Sequence[UUID],
        walk: Sequence[State],
        traceparents: Sequence[str | None] | None = None,
        placing: Placing | None = None,
    ) -> list[tuple[Task, bool] | None]:
        """Create tasks and walk the new ones from Created through `walk` (checked by the FSM)
        in one statement. Returns each task with whether this statement created it: existing
        ones (a redelivery, a taken idempotency key) come back as they are; None for an id
        without a key that retention deleted (the same submission again, already run).

        With `placing`, the same statement (sked_admit) then places the new ones as planned,
        under the planned nodes' locks: a node takes its tasks only if it is still live, of
        the same incarnation, and has room for all of them; the rest stay Ready. Outside a
        transaction that is one round trip and one commit for admission and placement."""
        tasks, fresh = await self._create(specs, ids, walk, traceparents, placing=placing)
        created = {t.id for t in fresh}
        return [None if t is None else (t, t.id in created) for t in tasks]

    async def create_many(
        self,
        specs: Sequence[TaskSpec],
        ids: Sequence[UUID] | None = None,
        walk: Sequence[State] = (),
        traceparents: Sequence[str | None] | None = None,
        workflow_id: UUID | None = None,
        uses: Sequence[Sequence[str]] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[Task]:
        """Insert tasks in Created (or walked on through `walk`) with their events; one round
        trip for the batch. `ids`: producer-chosen ids (a submission delivered twice is one
        task); `priorities`: the effective ones a workflow's tasks are queued by (the spec
        keeps the priority its producer asked for)."""
        tasks, _ = await self._create(specs, ids, walk, traceparents, workflow_id, uses, priorities)
        for t, task_id in zip(tasks, ids or (), strict=False):
            if t is None:  # a workflow's task under an id once a plain task's (crafted)
                raise InvalidSpec(f"task id {task_id} names a task retention deleted")
        return [t for t in tasks if t is not None]

    async def _create(
        self,
        specs: Sequence[TaskSpec],
        ids: Sequence[UUID] | None,
        walk: Sequence[State],
        traceparents: Sequence[str | None] | None = None,
        workflow_id: UUID | None = None,
        uses: Sequence[Sequence[str]] | None = None,
        priorities: Sequence[int] | None = None,
        placing: Placing | None = None,
    ) -> tuple[list[Task | None], list[Task]]:
        """All the tasks asked for, in order (None: an id retention deleted, not created
        again), and those this call created."""
        if not specs:
            return [], []
        ids = list(ids) if ids is not None else [uuid4() for _ in specs]
        steps = fsm.walk(State.CREATED, walk)
        started = time.time_ns()
        query = Q.insert_tasks
        placed: tuple[Any, ...] = ()
        if placing is not None and placing.moves:
            nodes = list(placing.boot_ids)
            query = Q.admit_and_place
            placed = (
                *move_args(placing.moves),
                nodes,
                [placing.boot_ids[n] for n in nodes],
                placing.node_ttl_s,
                self.db.lease_margin_s,
            )
        rows = await self.db.fetch(
            query,
            ids,
            [s.name for s in specs],
            [s.job.kind for s in specs],
            [s.model_dump_json() for s in specs],
            list(priorities) if priorities is not None else [s.priority for s in specs],
            [s.max_retries for s in specs],
            [s.timeout_s for s in specs],
            [s.heartbeat_timeout_s for s in specs],
            [s.idempotency_key for s in specs],
            [s.resources.cpu for s in specs],
            [s.resources.memory_mb for s in specs],
            [s.resources.gpu for s in specs],
            *steps,
            list(traceparents) if traceparents is not None else [None] * len(specs),
            workflow_id,
            [json.dumps(list(u)) for u in uses] if uses is not None else ["[]"] * len(specs),
            [s.schedule_timeout_s for s in specs],
            [s.max_launch_failures for s in specs],
            *placed,
        )
        created = {t.id: t for t in tasks_of(rows)}
        by_id: dict[UUID, Task] = {}
        by_key: dict[str, Task] = {}
        if len(created) < len(ids):
            keys = [s.idempotency_key for s in specs if s.idempotency_key is not None]
            for row in await self.db.fetch(Q.existing_tasks, ids, keys):
                found = task(row)
                by_id[found.id] = found
                if found.idempotency_key is not None:
                    by_key[found.idempotency_key] = found
        out: list[Task | None] = []
        for task_id, spec in zip(ids, specs, strict=True):
            got = created.get(task_id) or by_id.get(task_id)
            if got is None and spec.idempotency_key is not None:
                got = by_key.get(spec.idempotency_key)
            out.append(got)
        missing = {i: s for i, s, t in zip(ids, specs, out, strict=True) if t is None}
        if missing:  # read only on a miss: kept out of the insert's round trip
            gone = {r["id"] for r in await self.db.fetch(Q.tasks_purged, list(missing))}
            # a keyed one missing met a purge of its key's old task: not this submission's
            lost = [i for i, s in missing.items() if s.idempotency_key or i not in gone]
            if lost:
                raise RuntimeError(f"task {lost[0]} was neither created nor found")
        if hooks.installed:
            hooks.transitions(
                [
                    (t, Move(t.id, i + 1, State(src), State(dst), why))
                    for t in created.values()
                    for i, (src, dst, why) in enumerate(zip(*steps, strict=True))
                    if src is not None
                ],
                started,
                time.time_ns(),
            )
            if placing is not None:
                hooks.transitions(
                    [
                        (t, m)
                        for m in placing.moves
                        if (t := created.get(m.task_id)) is not None and t.status is m.target
                    ],
                    started,
                    time.time_ns(),
                )
        return out, list(created.values())

    # -- transitions ------------------------------------------------------------------------

    async def transition(self, move: Move) -> Task | None:
        """Apply one planned move. Returns the task after it, or None if this caller lost."""
        moved = await self.transition_many([replace(move, read_back=True)])
        return moved[0] if moved else None

    async def transition_many(self, moves: Sequence[Move]) -> Moved:
        """Apply many moves in one statement; returns the tasks that moved (the CAS winners),
        in the order of `moves`: their rows, where the move asked for it back (`Moved`)."""
        out = Moved()
        if not moves:
            return out
        started = time.time_ns()
        args = (*move_args(moves), self.db.lease_margin_s)
        if all(m.read_back for m in moves):
            rows = await self.db.fetch(Q.transition, *args)
        else:
            # the row of a move not read back: what a move decides, and with a hook installed
            # what a hook reads too (hooks.SEEN), not the whole row (fragment task_columns_at)
            bare = _SEEN_BY_HOOKS if hooks.installed else _DECIDED
            levels = [_WHOLE if m.read_back else bare for m in moves]
            rows = await self.db.fetch(Q.transition_thin, *args, levels)
        won = {row["id"]: row for row in rows}
        out.ids = frozenset(won)
        out.rows = won
        if hooks.installed:
            won_moves = [m for m in moves if m.task_id in won]
            tasks = tasks_of([won[m.task_id] for m in won_moves])
            moved = list(zip(tasks, won_moves, strict=True))
            hooks.transitions(moved, started, time.time_ns())
            out.extend(t for (t, m) in moved if m.read_back)
        else:
            back = [won[m.task_id] for m in moves if m.read_back and m.task_id in won]
            out.extend(tasks_of(back))
        return out

    # -- reads ------------------------------------------------------------------------------

    async def get(self, task_id: UUID) -> Task:
        return await get_task(self.db, task_id)

    async def get_many(self, ids: Sequence[UUID]) -> list[Task]:
        return tasks_of(await self.db.fetch(Q.get_tasks, list(ids)))

    async def list_tasks(
        self,
        statuses: Iterable[object] | None = None,
        name: str | None = None,
        limit: int = 100,
        after: UUID | None = None,
    ) -> list[Task]:
        """Tasks newest first; with `after`, those that follow that task (the last of the page
        before) in this order. Raises NotFound for an unknown `after`."""
        states = State if statuses is None else statuses
        wanted = list(dict.fromkeys(State.parse(s).value for s in states))
        rows = await self.db.fetch(Q.list_tasks, wanted, name, limit, after)
        if not rows and after and not await self.db.fetchval(Q.task_cursor_known, after):
            raise NotFound(f"no task {after} to list after")
        return [task(row) for row in rows]

    async def history(self, task_id: UUID) -> list[Event]:
        rows = await self.db.fetch(Q.history, task_id)
        if not rows:
            await self.get(task_id)  # raises NotFound for an unknown id
        return [Event.model_validate(dict(row)) for row in rows]

    async def terminal_among(self, ids: Sequence[UUID]) -> list[Task]:
        """Those of `ids` that are terminal (never move again)."""
        return [task(row) for row in await self.db.fetch(Q.terminal_among, list(ids))]

    async def get_ready(self, ids: Sequence[UUID]) -> tuple[list[Task], list[Task]]:
        """Those of `ids` still Ready (a popped id may have been canceled meanwhile): the ones
        that may start, and the ones an earlier attempt's lease still fences."""
        free: list[Task] = []
        fenced: list[Task] = []
        for row in await self.db.fetch(Q.get_ready, list(ids), self.db.lease_margin_s):
            (fenced if row["_fenced"] else free).append(task(row))
        return free, fenced

    async def ready_among(self, ids: Sequence[UUID]) -> set[UUID]:
        """Those of `ids` that are Ready."""
        return {r["id"] for r in await self.db.fetch(Q.ready_among, list(ids))}

    async def ready_for_queue(
        self, older_than_s: float, limit: int, after: QueuedRow | None = None
    ) -> list[QueuedRow]:
        """Ready tasks queued more than `older_than_s` ago, oldest first, from after `after`."""
        start: tuple[datetime, UUID] = (datetime.min.replace(tzinfo=UTC), UUID(int=0))
        if after is not None and after.queued_at is not None:
            start = (after.queued_at, after.id)
        rows = await self.db.fetch(Q.ready_for_queue, older_than_s, limit, *start)
        return [QueuedRow(r["id"], r["priority"], r["queued_at"]) for r in rows]

    async def set_wait_reasons(self, reasons: dict[UUID, str]) -> None:
        if reasons:
            await self.db.execute(Q.set_wait_reasons, list(reasons), list(reasons.values()))

    async def still_placed(self, attempts: Sequence[tuple[UUID, int, str]]) -> set[UUID]:
        """Of these (task id, attempt, node), the tasks still Scheduling in that attempt on
        that node: placed, and not claimed by its executor yet."""
        if not attempts:
            return set()
        wanted = set(attempts)
        rows = await self.db.fetch(Q.still_placed, [a[0] for a in attempts])
        return {r["id"] for r in rows if (r["id"], r["attempt"], r["node"]) in wanted}

    async def ended_with(self, attempts: Sequence[tuple[UUID, int]], reason: str) -> set[UUID]:
        """Of these (task id, version while Running), the tasks whose very next move left
        Running with a reason starting with `reason`: an end this writer already applied."""
        if not attempts:
            return set()
        ids, versions = (list(x) for x in zip(*attempts, strict=True))
        return {r["task_id"] for r in await self.db.fetch(Q.ended_with, ids, versions, reason)}

    async def next_retry_due(self) -> float | None:
        """Seconds until the earliest retry is due (Postgres time); None if none waits."""
        due: float | None = await self.db.fetchval(Q.next_retry_due)
        return due

    async def next_schedule_deadline(self) -> float | None:
        """Seconds until the earliest schedule timeout of a task waiting to start runs out
        (Postgres time; negative when overdue); None if no waiting task has one."""
        due: float | None = await self.db.fetchval(Q.next_schedule_deadline)
        return due

    # -- priorities -------------------------------------------------------------------------

    async def reprioritise(self, target: Task, priority: int) -> list[Task]:
        """Set `target`'s own priority and recompute the effective priorities it changes (for
        a workflow task: every task upstream of it inherits the highest downstream priority).
        Returns the tasks written: the task itself and each whose effective priority moved."""
        async with self.db.atomic() as db:
            if target.workflow_id is None:
                effective = {target.id: priority}
            else:
                await db.execute(Q.lock_workflow_priorities, str(target.workflow_id))
                rows = await db.fetch(Q.workflow_priorities, target.workflow_id)
                ids = {r["wf_task"]: r["id"] for r in rows}
                names = {r["id"]: r["wf_task"] for r in rows}
                current = {r["id"]: r["priority"] for r in rows}
                own = {r["wf_task"]: r["own"] for r in rows}
                own[target.wf_task] = priority
                needs: dict[str, list[str]] = {name: [] for name in own}
                for edge in await db.fetch(Q.workflow_edges, target.workflow_id):
                    needs[names[edge["task_id"]]].append(names[edge["upstream_id"]])
                effective = {
                    ids[name]: p
                    for name, p in effective_priorities(own, needs).items()
                    if p != current[ids[name]] or ids[name] == target.id
                }
            rows = await db.fetch(
                Q.set_priorities, list(effective), list(effective.values()), target.id, priority
            )
            if all(r["id"] != target.id for r in rows):  # it ended since the caller's read
                raise NotAllowed(f"cannot reprioritise task {target.id}: it has ended")
        return [task(r) for r in rows]
