"""Placement: filter nodes by what a task needs, score the rest, pick the best (pure, no I/O).

Filter: ready, a free slot, free cpu / memory / gpu, every selector label. Score (higher wins):

    0.5 * free-resource ratio after placing (mean over slots, cpu, memory, gpu the node has)
  + 0.3 * (1 - reported load)
  + 0.2 * affinity (share of the task's preferred labels the node carries)

so work spreads to the emptiest, least loaded node, nudged by preferences; ties go to the
lowest node id, so two schedulers with the same view decide the same way. A task placed again
(a retry, or a dispatch handed back) goes to another node than its last whenever one fits:
the node it was lost on, or that handed it back, comes last, whatever its score. When nothing fits,
`reason` names the first requirement no node can meet at all (`no node has gpu >= 2`), or says
that nodes which could take the task are all full.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar
from uuid import UUID

W_FREE, W_LOAD, W_AFFINITY = 0.5, 0.3, 0.2
EPS = 1e-9


LATE_S = 1.0  # a node heard from this much later than another loses a tie to it


@dataclass(frozen=True)
class Need:
    cpu: float = 0.0
    memory_mb: int = 0
    gpu: int = 0
    selector: Mapping[str, str] = field(default_factory=dict)
    affinity: Mapping[str, str] = field(default_factory=dict)
    avoid: str | None = None  # the node of the task's last attempt: chosen only if alone


@dataclass(frozen=True)
class NodeState:
    id: str
    slots: int
    cpu: float
    memory_mb: int
    gpu: int
    labels: Mapping[str, str] = field(default_factory=dict)
    ready: bool = True
    load: float = 0.0
    used_slots: int = 0
    used_cpu: float = 0.0
    used_memory_mb: int = 0
    used_gpu: int = 0
    # live and registered, but cordoned by an operator: not ready, and named in reasons
    cordoned: bool = False
    # dispatches it takes beyond its slots: its executor holds them (Scheduling) and starts
    # each as a slot frees. Slot usage counts them; cpu, memory and gpu are reserved as ever.
    prefetch: int = 0
    # when its executor last heartbeat (epoch seconds, Postgres's clock; 0: unknown): between
    # equally good nodes, one heard from LATE_S later than another loses, so a node frozen
    # or cut off (still within its TTL, its load as it last reported it) is not picked over
    # one that beats on time
    heard_at: float = 0.0

    @property
    def capacity(self) -> int:
        """How many attempts may hold this node at once: running, or dispatched and held."""
        return self.slots + self.prefetch

    @property
    def room(self) -> int:
        """How many more attempts it may take now (slots and backlog; resources aside)."""
        return max(self.capacity - self.used_slots, 0)

    def full(self) -> NodeState:
        """This node with no room left (its slots and backlog all held)."""
        return replace(self, used_slots=max(self.used_slots, self.capacity))

    def placed(self, need: Need) -> NodeState:
        """This node after reserving `need` on it."""
        return self._with_use(1, need.cpu, need.memory_mb, need.gpu)

    def released(self, need: Need) -> NodeState:
        return self._with_use(-1, -need.cpu, -need.memory_mb, -need.gpu)

    def _with_use(self, slots: int, cpu: float, memory_mb: int, gpu: int) -> NodeState:
        # Copied field by field rather than through dataclasses.replace, which re-reads the
        # class's fields and calls __init__: ~4 µs a call, and a placement pass calls this
        # once per task placed (docs/performance.md).
        after = object.__new__(NodeState)
        values = after.__dict__
        values.update(self.__dict__)
        values["used_slots"] = self.used_slots + slots
        values["used_cpu"] = self.used_cpu + cpu
        values["used_memory_mb"] = self.used_memory_mb + memory_mb
        values["used_gpu"] = self.used_gpu + gpu
        return after


def _selector_text(selector: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def matches(node: NodeState, selector: Mapping[str, str]) -> bool:
    return all(node.labels.get(k) == v for k, v in selector.items())


def capacity_gap(node: NodeState, need: Need) -> str | None:
    """The first total capacity of `node` too small for `need` (ignoring what is in use)."""
    if node.cpu + EPS < need.cpu:
        return f"cpu >= {need.cpu:g}"
    if node.memory_mb < need.memory_mb:
        return f"memory_mb >= {need.memory_mb}"
    if node.gpu < need.gpu:
        return f"gpu >= {need.gpu}"
    return None


def fits(node: NodeState, need: Need) -> bool:
    """Every filter: ready, selector, and room for the task right now."""
    return (
        node.ready
        and matches(node, need.selector)
        and node.room > 0
        and node.used_cpu + need.cpu <= node.cpu + EPS
        and node.used_memory_mb + need.memory_mb <= node.memory_mb
        and node.used_gpu + need.gpu <= node.gpu
    )


def score(node: NodeState, need: Need) -> float:
    # The ratios after placing, summed in the order sum() over a list of them would: the same
    # float, without building the node after placement or the list.
    free = 1 - (node.used_slots + 1) / node.capacity
    kinds = 1
    if node.cpu > 0:
        free += 1 - (node.used_cpu + need.cpu) / node.cpu
        kinds += 1
    if node.memory_mb > 0:
        free += 1 - (node.used_memory_mb + need.memory_mb) / node.memory_mb
        kinds += 1
    if node.gpu > 0:
        free += 1 - (node.used_gpu + need.gpu) / node.gpu
        kinds += 1
    load = 1 - min(max(node.load, 0.0), 1.0)
    affinity = (
        sum(node.labels.get(k) == v for k, v in need.affinity.items()) / len(need.affinity)
        if need.affinity
        else 0.0
    )
    return W_FREE * (free / kinds) + W_LOAD * load + W_AFFINITY * affinity


@dataclass(frozen=True)
class Choice:
    node: NodeState | None
    reason: str = ""
    # True when some node could take the task once it has room: wait in line. False when no
    # node can take it at all (too small, wrong labels, not ready): park until nodes change.
    fits_later: bool = False
    # set when the task waits for a named workflow resource rather than for a node
    resource: str | None = None


def why_not(need: Need, nodes: Sequence[NodeState]) -> str:
    """Why no node fits `need`: the first requirement that rules out every node, or that the
    nodes that could take it are all full (`waits_for_room` tells the two apart); and how many
    cordoned nodes could have taken it."""
    reason = _why_not(need, nodes)
    cordoned = sum(
        1 for n in nodes if n.cordoned and matches(n, need.selector) and not capacity_gap(n, need)
    )
    return f"{reason} ({cordoned} cordoned node(s) could take it)" if cordoned else reason


def _why_not(need: Need, nodes: Sequence[NodeState]) -> str:
    ready = [n for n in nodes if n.ready]
    if not ready:
        return "no ready node"
    matching = [n for n in ready if matches(n, need.selector)]
    if not matching:
        return f"no node matches selector {_selector_text(need.selector)}"
    sized = [n for n in matching if capacity_gap(n, need) is None]
    if not sized:
        gaps = {capacity_gap(n, need) for n in matching}
        return f"no node has {' or '.join(sorted(g for g in gaps if g))}"
    return f"all {len(sized)} node(s) that fit are full"


def waits_for_room(need: Need, nodes: Sequence[NodeState]) -> bool:
    """Some ready node could take `need` once enough of what runs on it has finished."""
    return any(
        n.ready and matches(n, need.selector) and capacity_gap(n, need) is None for n in nodes
    )


def choose(need: Need, nodes: Sequence[NodeState]) -> Choice:
    candidates = [n for n in nodes if fits(n, need)]
    if not candidates:
        return Choice(None, why_not(need, nodes), waits_for_room(need, nodes))
    last = max(n.heard_at for n in candidates)
    return Choice(
        min(
            candidates,
            key=lambda n: (n.id == need.avoid, -score(n, need), n.heard_at < last - LATE_S, n.id),
        )
    )


K = TypeVar("K", bound=Hashable)


def place_many(
    needs: Sequence[tuple[K, Need]], nodes: Sequence[NodeState], units: Units | None = None
) -> tuple[dict[K, str], dict[K, Choice]]:
    """Place tasks in the given order, each seeing the reservations of those before it — on
    the nodes, and of the named workflow resources (`units`) they use: a unit is taken only by
    a task a node takes, so one that no node takes keeps no other from its resource.

    Returns ({key: node id}, {key: the Choice that found no node, or the resource it waits
    for: its reason, and whether it only waits for room}).
    """
    state = {n.id: n for n in nodes}
    placed: dict[K, str] = {}
    unplaced: dict[K, Choice] = {}
    for key, need in needs:
        wait = None if units is None else units.wait(key)
        if wait is not None:
            unplaced[key] = wait
            continue
        choice = choose(need, list(state.values()))
        if choice.node is None:
            unplaced[key] = choice
        else:
            placed[key] = choice.node.id
            state[choice.node.id] = choice.node.placed(need)
            if units is not None:
                units.take(key)
    return placed, unplaced


class UsesResources(Protocol):
    """A task as the workflow-resource check sees it."""

    @property
    def id(self) -> UUID: ...
    @property
    def workflow_id(self) -> UUID | None: ...
    @property
    def uses(self) -> list[str]: ...


class Units:
    """The units of named workflow resources a placement pass may hand out: {(workflow,
    resource): (units held, capacity)} as read under the placement locks, and which of them
    each task uses; a task placed takes one of each."""

    def __init__(
        self, tasks: Iterable[UsesResources], held: Mapping[tuple[UUID, str], tuple[int, int]]
    ) -> None:
        self.taken = dict(held)
        self.uses: dict[Hashable, list[tuple[UUID, str]]] = {
            t.id: [(t.workflow_id, r) for r in t.uses if (t.workflow_id, r) in held]
            for t in tasks
            if t.workflow_id is not None and t.uses
        }

    def wait(self, task_id: Hashable) -> Choice | None:
        """Why the task must wait for a resource (every unit held), or None."""
        for key in self.uses.get(task_id, ()):
            units, capacity = self.taken[key]
            if units >= capacity:
                why = f"waiting for resource {key[1]} ({units}/{capacity} held)"
                return Choice(None, why, True, key[1])
        return None

    def take(self, task_id: Hashable) -> None:
        for key in self.uses.get(task_id, ()):
            units, capacity = self.taken[key]
            self.taken[key] = (units + 1, capacity)
