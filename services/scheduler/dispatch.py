"""Dispatch: pop by aged priority, place on nodes under their row locks, CAS Ready ->
Scheduling with the node, and send each attempt to its node's queue after the commit. Woken
by intake, by capacity being freed (NOTIFY) and by nodes joining — never a tight poll."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from uuid import UUID

from services.scheduler.hub import Hub
from services.scheduler.sending import Sender
from shared import fsm, hooks
from shared.bus import AmqpBus
from shared.degrade import Mode
from shared.fsm import State
from shared.models import Task, TaskSpec
from shared.placement import Choice, Need, NodeState, Units, place_many
from shared.queues import FENCED_KEY, RESOURCE_KEY, ReadyQueue
from shared.resilience import TRANSIENT
from shared.runtime import wait_any
from shared.settings import Settings
from shared.store import Store, Tx

log = logging.getLogger(__name__)

PLACED = "placed"  # the reason of a placement's move


def need_of(task: Task) -> Need:
    selector, affinity = task.labels()
    return Need(
        cpu=task.cpu,  # the spec's resources, stored as columns at admission
        memory_mb=task.memory_mb,
        gpu=task.gpu,
        selector=selector,
        affinity=affinity,
        avoid=task.node,  # its last attempt's (None before the first placement)
    )


def need_of_spec(spec: TaskSpec) -> Need:
    """What a task about to be created needs (it has no last node to avoid)."""
    r = spec.resources
    return Need(r.cpu, r.memory_mb, r.gpu, spec.selector, spec.affinity)


class Dispatcher(Sender):
    def __init__(
        self, settings: Settings, store: Store, bus: AmqpBus, queue: ReadyQueue, hub: Hub
    ) -> None:
        super().__init__(settings, store, queue, hub)
        self.bus = bus
        # partial mode: where the last pass's candidates ended (_pop_urgent)
        self._urgent_after: tuple[int, datetime, UUID] | None = None
        # the last pass's pop may have left work it could place behind: entries of tasks no
        # longer Ready, or members that name no task, took the slots it popped for
        self._stale = False
        # tasks the last pass put back in line while nodes kept room (a node that fits them is
        # full, another idle): the next pass pops that many more, to reach what is behind them
        self._behind = 0

    async def run(self, stopping: asyncio.Event) -> None:
        hub = self.hub
        while not stopping.is_set():
            hub.dispatch.clear()
            hub.new_work.clear()
            asked = hub.returns_asked
            if hub.unpark.is_set():
                hub.unpark.clear()
                await self.queue.unpark()
            if hub.unpark_resources.is_set():
                hub.unpark_resources.clear()
                aside, hub.waiting_aside = hub.waiting_aside, set()  # set again by re-parks
                for key in sorted(aside):
                    await self.queue.unpark(key)
            hub.returns_done = asked  # in line now: intake's size() counts them
            # a full batch went out, or what the pass popped was not all placeable work
            # (tasks paused or canceled while in line, members naming no task): there may be
            # more to place right away
            while await self.timed_pass() >= self.settings.dispatch_batch or self._stale:
                pass
            await wait_any(hub.dispatch, stopping, timeout=self.settings.reconcile_s)
            if not hub.new_work.is_set():
                # woken by a freed slot: let a few more free up so one pass places them all;
                # new work cuts this short, so a submission never waits for it
                await wait_any(hub.new_work, stopping, timeout=self.settings.dispatch_linger_s)

    async def timed_pass(self) -> int:
        """`dispatch_once`, its duration told to the hooks (metrics: sked_dispatch_pass_seconds)."""
        started = time.perf_counter()
        placed = await self.dispatch_once()
        hooks.dispatch_pass(time.perf_counter() - started, placed)
        return placed

    async def dispatch_once(self) -> int:
        """One pass: place as many queued tasks as nodes have room for. Returns how many.

        The nodes' rows stay locked from reading their usage to the CAS that reserves on them,
        so two schedulers placing at once serialise here and neither overcommits a node.
        """
        self._stale = False
        behind, self._behind = self._behind, 0
        if self.hub.degrade.mode() is Mode.FULL:
            return 0  # degraded: nothing is dispatched (the pass below checks the row itself)
        if not await self.queue.size():
            return 0  # most wake-ups (a task finished) find nothing queued: skip the locks
        ends = self.hub.ends
        ids: list[UUID] = []
        known: list[Task] = []  # popped tasks as this scheduler queued them (queued.py)
        short = False  # the pop took fewer than it asked for
        try:
            async with self.store.transaction() as tx:
                rows, mode = await tx.nodes.lock_and_read()
                nodes = self.hub.routable([n.state() for n in rows])
                free = sum(n.room for n in nodes if n.ready)
                if free <= 0:
                    return 0
                if mode is None:
                    mode = (await tx.degrade.read()).effective()
                if mode is Mode.FULL:
                    return 0
                if mode is Mode.PARTIAL:
                    ids = unknown = await self._pop_urgent(tx, free)
                else:
                    asked = min(free + behind, self.settings.dispatch_batch)
                    popped = await self.queue.pop_scored(asked)
                    short = len(popped) < asked
                    ids = [task_id for task_id, _ in popped]
                    known, unknown = self.hub.queued.take(popped)
                if not ids:
                    self._stale = short  # it popped only members that name no task
                    return 0
                tasks, fenced = await tx.tasks.get_ready(unknown) if unknown else ([], [])
                self._stale = len(tasks) + len(fenced) < len(unknown)
                order = {task_id: i for i, task_id in enumerate(ids)}
                tasks = sorted(tasks + known, key=lambda t: order[t.id])
                moved, waiting = await self.place(tx, tasks, nodes, mode)
        except BaseException:  # transient, or a bug that stops the service: none is lost
            await self._put_back(ids)
            raise
        for task in fenced:
            # paused while its executor could not hear it: the old attempt may run until its
            # lease runs out, so this one waits aside (docs: at most one live attempt)
            waiting[task.id] = Choice(
                None, f"waiting for attempt {task.lease_attempt} to stop (its lease)"
            )
        await self.hand_over(moved, tasks, waiting, ends, fenced)
        if known:
            # a kept copy whose CAS lost: the task changed since it was queued (paused,
            # canceled, placed elsewhere). Read afresh; what is still Ready goes back in line
            placed = {t.id for t in moved}
            await self._put_back(
                [t.id for t in known if t.id not in placed and t.id not in waiting]
            )
        in_line = sum(_kind(c) == "line" for c in waiting.values())
        if short and not in_line:
            # the pop came back short, yet nothing it took went back in line: members that
            # name no task may have taken slots from tasks behind them (or the line is empty,
            # and the next pass says so with one ZCARD)
            self._stale = True
        elif in_line and free > len(moved) and mode is Mode.NORMAL:
            # tasks waiting for a full node took the pop of a node with room: the next pass
            # looks past them (deeper each time, up to a batch: at the bottom of the line, or
            # a batch deep, it waits for a wake-up as before)
            self._behind = in_line
            self._stale = not short and asked < self.settings.dispatch_batch
        return len(moved)

    async def _pop_urgent(self, tx: Tx, free: int) -> list[UUID]:
        """Partial mode: only tasks at or above the threshold priority, a small batch per
        pass, chosen in Postgres (index tasks_runnable) and taken out of the queue; those
        below wait in line untouched."""
        s = self.settings
        limit = min(free, s.degrade_partial_batch)
        rows = await tx.degrade.ready_at_least(s.degrade_min_priority, limit, self._urgent_after)
        # the next pass goes on past these, and from the top once the end is reached: tasks
        # that cannot be placed yet (a held GPU) no longer take every batch from those behind
        self._urgent_after = rows[-1] if len(rows) == limit else None
        ids = [task_id for _, _, task_id in rows]
        await self.queue.remove(ids)
        return ids

    async def _put_back(self, ids: list[UUID]) -> None:
        """The pass failed after its pop (nothing it wrote committed): return the popped tasks
        to the queue now rather than leave them to the reconcile period. If Postgres is the
        one away, reconciliation re-adds them once it is back."""
        if not ids:
            return
        with contextlib.suppress(*TRANSIENT):
            free, fenced = await self.store.tasks.get_ready(ids)
            await self.queue.push(free + fenced)

    async def place(
        self,
        tx: Tx,
        tasks: list[Task],
        nodes: list[NodeState] | None = None,
        mode: Mode | None = None,
    ) -> tuple[list[Task], dict[UUID, Choice]]:
        """Inside a transaction: place `tasks` in order on the locked nodes and CAS the placed
        ones Ready -> Scheduling. Returns them, and {task id: why not} for the rest.

        The degrade mode in force (read in this transaction unless given) decides first:
        full places nothing, partial only tasks at or above the threshold priority, a small
        batch; the rest wait in line with the reason.

        Workflow tasks whose named resource is fully held wait (a holder's end frees a unit
        and wakes dispatch); the units are counted under the placement locks, so two passes
        never hand out the same one."""
        if nodes is None:
            rows, read_mode = await tx.nodes.lock_and_read()
            nodes = [n.state() for n in rows]
            mode = mode or read_mode
        if mode is None:
            mode = (await tx.degrade.read()).effective()
        tasks, held_back = self._degraded(tasks, mode)
        users = {t.workflow_id for t in tasks if t.uses and t.workflow_id is not None}
        # the workflows locked first, then their units counted: a pass whose live nodes are
        # not this one's (a node came or went between them) still waits for it here
        held = {}
        if users:
            await tx.workflows.lock(list(users))
            held = await tx.workflows.resources_held(list(users))
        units = Units(tasks, held) if held else None
        placed, unplaced = place_many([(t.id, need_of(t)) for t in tasks], nodes, units)
        unplaced.update(held_back)
        # what a dispatch needs of each moved row comes back alone (the repository still
        # hands a hook's `transitions` the rows whole)
        moves = [
            fsm.plan(t, State.SCHEDULING, PLACED, read_back=False, node=placed[t.id])
            for t in tasks
            if t.id in placed
        ]
        after = (await tx.tasks.transition_many(moves)).rows
        return [_as_placed(t, after[t.id]) for t in tasks if t.id in after], unplaced

    def _degraded(self, tasks: list[Task], mode: Mode) -> tuple[list[Task], dict[UUID, Choice]]:
        """The tasks the mode lets through, and a reason for each held back (in line)."""
        if mode is Mode.NORMAL:
            return tasks, {}
        s = self.settings
        if mode is Mode.FULL:
            urgent: list[Task] = []
        else:
            above = [t for t in tasks if t.priority >= s.degrade_min_priority]
            urgent = above[: s.degrade_partial_batch]
        why = (
            "degraded: full mode, nothing is dispatched"
            if mode is Mode.FULL
            else f"degraded: partial mode, only priority >= {s.degrade_min_priority}"
        )
        let = {t.id for t in urgent}
        return urgent, {t.id: Choice(None, why, True) for t in tasks if t.id not in let}

    async def hand_over(
        self,
        moved: list[Task],
        tasks: list[Task],
        waiting: dict[UUID, Choice],
        ends: int,
        fenced: list[Task],
    ) -> None:
        """After COMMIT: dispatch what was placed; queue the rest with the reason they wait —
        in line if a node could take them once it has room, parked if none can at all, aside
        if an earlier attempt's lease fences them.

        Dispatches go out only after the commit: an executor whose CAS ran before it would not
        see the Scheduling row (its snapshot predates the commit) and would drop the attempt.
        """
        try:
            await self.send(moved)
        finally:  # what waits goes back in line whatever became of the dispatches
            await self.queue_waiting(tasks, waiting, ends, fenced=fenced)

    async def queue_waiting(
        self,
        tasks: list[Task],
        waiting: dict[UUID, Choice],
        ends: int,
        nodes: int | None = None,
        fenced: list[Task] | None = None,
    ) -> None:
        """Tasks a node can take once it has room go back in line; those no node can take
        are parked until nodes change; those waiting for a named resource until a task ends;
        `fenced` ones (their reasons in `waiting`) until an earlier attempt's lease ends.
        `ends` is the count of task-end notifications before the resources were counted: if
        one came since, a holder may have ended unseen, so the resource waiters go back now.
        `nodes`, likewise, is Hub.node_changes when the nodes planned on were read, for a
        caller outside the dispatch loop (intake): that loop unparks after its own passes."""
        if not waiting:
            return
        hub = self.hub
        kinds: dict[str, list[Task]] = {"line": [], "parked": [], "resource": []}
        for task in tasks:
            choice = waiting.get(task.id)
            if choice is not None:
                kinds[_kind(choice)].append(task)
        await self.queue.push(kinds["line"], back=True)
        score = self.queue.score_of
        hub.queued.keep((t, score(t)) for t in kinds["line"] if t.queued_at is not None)
        await self.queue.park(kinds["parked"])
        if kinds["parked"] and nodes is not None and hub.node_changes != nodes:
            # a node changed since the read: the unpark its notification asked for may have
            # run before this park, and nothing else would bring these back
            hub.ask_unpark()
        aside = [(RESOURCE_KEY, kinds["resource"]), (FENCED_KEY, fenced or [])]
        for key, some in aside:
            if some:
                await self.queue.park(some, key)
                hub.waiting_aside.add(key)
                if hub.ends != ends:
                    hub.unpark_resources.set()
        if kinds["parked"] or kinds["resource"] or fenced:
            # they left the queue: the tasks behind them get the slots they were popped for
            hub.work_arrived()
        await self.store.tasks.set_wait_reasons(
            {k: c.reason for k, c in waiting.items() if c.reason}
        )


def _kind(choice: Choice) -> str:
    """Where a task that waits goes: "line", "parked" (no node can take it) or "resource"."""
    return "resource" if choice.resource else "line" if choice.fits_later else "parked"


def _as_placed(before: Task, row: Mapping[str, Any]) -> Task:
    """A task as its placement left it, from its row before the move and what the move's
    statement returned (the status, version, attempt and node: what a dispatch carries and a
    take-back plans from). Its other columns are as they were before the move — the time of
    the move (updated_at) is not among them — so it is for sending its dispatch only. The
    row the CAS returned whole is ~15 µs a task more for Postgres and the scheduler."""
    placed = object.__new__(Task)
    values = placed.__dict__
    values.update(before.__dict__)
    values["status"] = State(row["status"])
    values["status_reason"] = PLACED
    values["version"] = row["version"]
    values["attempt"] = row["attempt"]
    values["node"] = row["node"]
    return placed
