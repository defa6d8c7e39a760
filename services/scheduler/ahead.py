"""Placement planned ahead of an admission: intake places new tasks in the statement that
creates them (sked_admit) when nothing waits in line, on the nodes as it last read them. That
statement checks each node's plan again under the node's lock, so a view a little old costs a
task its place in the fast path (it waits in line instead), never a slot given twice.

The view is read without locks (`nodes_with_usage`) and kept for VIEW_S, counting this
scheduler's own placements since; a node or degrade-mode notification, a refused plan, or
LISTEN coming back drops it. At 100 submissions a second the read was a round trip before
every admission (~0.5 ms of its submit -> start, docs/performance.md)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from uuid import UUID

from services.scheduler.dispatch import need_of_spec
from shared import fsm
from shared.degrade import Mode
from shared.fsm import State
from shared.models import Task, TaskSpec
from shared.placement import Choice, Need, NodeState, place_many
from shared.store import NodeRow, Placing

VIEW_S = 0.1  # how long a read of the nodes plans admissions


class NodeView:
    """The nodes as this scheduler last read them, with its own placements since."""

    def __init__(
        self,
        rows: Sequence[NodeRow],
        mode: Mode | None,
        generation: int,
        routable: Callable[[Sequence[NodeState]], list[NodeState]] = list,
    ) -> None:
        self.nodes = {n.id: n for n in routable([n.state() for n in rows])}
        self.boot_ids = {n.id: n.boot_id for n in rows}
        self.normal = mode in (None, Mode.NORMAL)
        self.generation = generation  # Hub.node_changes when read
        self.read_at = time.monotonic()

    def fresh(self, generation: int) -> bool:
        return generation == self.generation and time.monotonic() - self.read_at < VIEW_S

    def plan(
        self, specs: Sequence[TaskSpec], ids: Sequence[UUID], walk: Sequence[State], ttl_s: float
    ) -> tuple[Placing | None, dict[UUID, Choice], dict[UUID, Need]]:
        """Where each new task would go, as the moves Ready -> Scheduling for the admission's
        statement to check and apply; why those placed nowhere wait; and what each placed one
        needs (`placed` counts those the statement applied)."""
        if not self.normal:
            return None, {}, {}
        # in the line's order: higher priority first, then as they came (they share queued_at)
        line = sorted(zip(ids, specs, strict=True), key=lambda pair: -pair[1].priority)
        needs = {i: need_of_spec(s) for i, s in line}
        placed, unplaced = place_many(list(needs.items()), list(self.nodes.values()))
        if not placed:
            return None, unplaced, {}
        version = fsm.walked_version(walk)
        moves = [
            fsm.plan(
                fsm.Newborn(i, walk[-1], version, s.max_retries, s.max_launch_failures),
                State.SCHEDULING,
                "placed",
                node=placed[i],
            )
            for i, s in zip(ids, specs, strict=True)
            if i in placed
        ]
        boot_ids = {n: self.boot_ids[n] for n in set(placed.values())}
        return Placing(moves, boot_ids, ttl_s), unplaced, {i: needs[i] for i in placed}

    def placed(self, moved: Sequence[Task], needs: dict[UUID, Need]) -> None:
        """These planned tasks now hold their nodes."""
        for task in moved:
            node = self.nodes.get(task.node or "")
            need = needs.get(task.id)
            if node is not None and need is not None:
                self.nodes[node.id] = node.placed(need)
