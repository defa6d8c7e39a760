"""Degrade modes (pure): how much the schedulers dispatch while the cluster is under pressure.

normal   everything is dispatched
partial  only tasks at or above a priority threshold, and a small batch per pass
full     nothing is dispatched
Running work is never touched. The state lives in one Postgres row (shared.store.degrade), so
every scheduler replica obeys the same mode; it ends by itself at `until` (Postgres time).

An operator sets a mode by hand (`sked degrade`); one scheduler at a time evaluates the
automatic triggers (`decide`). An automatic mode never replaces an active manual one: the
operator's word holds until it ends or the operator lifts it. An operator's lift holds too:
no trigger degrades again until its `until` (`sked degrade off --for S`), or for
`Rules.calm_s` after it when it has none (`held`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum


class Mode(StrEnum):
    NORMAL = "normal"
    PARTIAL = "partial"
    FULL = "full"

    @property
    def rank(self) -> int:
        return {"normal": 0, "partial": 1, "full": 2}[self.value]


def in_force(mode: Mode, remaining_s: float | None) -> Mode:
    """The mode in force, given the seconds left until its end (None: no end): past it, none."""
    if remaining_s is not None and remaining_s <= 0:
        return Mode.NORMAL
    return mode


@dataclass(frozen=True)
class DegradeState:
    """The row as read, with `remaining_s`: seconds until `until` by Postgres's clock at the
    read (None: no end set)."""

    mode: Mode
    automatic: bool
    reason: str
    set_by: str
    since: datetime
    until: datetime | None
    version: int
    remaining_s: float | None = None
    calm_s: float | None = None  # seconds since the evaluator saw an automatic mode's cause gone

    def effective(self) -> Mode:
        """The mode in force: a mode past its `until` is over."""
        return in_force(self.mode, self.remaining_s)


@dataclass(frozen=True)
class Snapshot:
    """What the triggers look at, read in one statement."""

    nodes_total: int  # nodes seen lately (a node that left long ago no longer counts)
    nodes_healthy: int  # of those: ready, heartbeating
    gpu_total: int  # the healthy nodes' GPUs
    gpu_used: int  # GPUs held by attempts on them
    waiting: int  # tasks Ready
    outbox_backlog: int  # events not yet published
    unhealthy: Sequence[str] = field(default_factory=tuple)  # the nodes seen lately, not healthy
    back: Sequence[str] = field(default_factory=tuple)  # of those asked after: healthy again
    departed: Sequence[str] = field(default_factory=tuple)  # of those: left cleanly or forgotten
    at: datetime | None = None  # when it was read (Postgres time)


@dataclass(frozen=True)
class Rules:
    """The automatic triggers (brief §5's defaults; every one configurable)."""

    gpu_ratio: float = 0.95  # GPUs held above this share of the healthy nodes' -> partial
    gpu_for_s: float = 600.0
    healthy_ratio: float = 0.5  # fewer than this share of the nodes healthy -> full
    healthy_for_s: float = 1800.0
    waiting: int = 10_000  # more tasks than this waiting -> partial
    waiting_for_s: float = 300.0
    # an automatic mode whose cause has been gone this long ends early; an operator's lift
    # with no end of its own holds the triggers back this long
    calm_s: float = 60.0


@dataclass(frozen=True)
class Change:
    mode: Mode
    reason: str
    for_s: float | None  # None: until lifted
    automatic: bool


def triggered(snapshot: Snapshot, rules: Rules, backlog: bool = True) -> Change | None:
    """The strongest automatic trigger that holds, or None (`backlog`: whether the backlog's
    trigger may fire; see `backlog_rests`)."""
    s = snapshot
    if s.nodes_total and s.nodes_healthy < rules.healthy_ratio * s.nodes_total:
        why = (
            f"{s.nodes_healthy} of {s.nodes_total} nodes healthy (under {rules.healthy_ratio:.0%})"
        )
        return Change(Mode.FULL, why, rules.healthy_for_s, True)
    if s.gpu_total and s.gpu_used > rules.gpu_ratio * s.gpu_total:
        why = f"{s.gpu_used} of {s.gpu_total} GPUs allocated (over {rules.gpu_ratio:.0%})"
        return Change(Mode.PARTIAL, why, rules.gpu_for_s, True)
    if backlog and s.waiting > rules.waiting:
        why = f"{s.waiting} tasks waiting (over {rules.waiting})"
        return Change(Mode.PARTIAL, why, rules.waiting_for_s, True)
    return None


def backlog_rests(state: DegradeState, snapshot: Snapshot, rules: Rules) -> bool:
    """Whether the backlog's trigger rests: for `waiting_for_s` after any mode ended (at its
    `until`, or lifted by an operator), by Postgres's clock.

    A mode dispatches none of the tasks below its threshold (partial) or none at all (full),
    so the backlog it leaves is at least the one it found. Were the backlog's trigger to fire
    again at once, those tasks would never be dispatched, however long they waited — and
    every accepted task must reach a terminal state (brief §9.1). In the rest they are
    dispatched as usual; then the trigger judges the backlog again. The other triggers judge
    what dispatching does not change (GPUs held, nodes healthy) and never rest."""
    if state.mode is not Mode.NORMAL:
        left_s = state.remaining_s
        # past its until, not yet written as ended: it ended -left_s seconds ago
        return left_s is not None and left_s <= 0 and -left_s < rules.waiting_for_s
    if state.version <= 1 or snapshot.at is None:
        return False  # never degraded (the row as its migration left it), or no clock
    return (snapshot.at - state.since).total_seconds() < rules.waiting_for_s


def decide(state: DegradeState, snapshot: Snapshot, rules: Rules) -> Change | None:
    """The automatic evaluator's move, if any: enter or strengthen an automatic mode when a
    trigger holds; end a mode whose `until` has passed (its leaving is an event too); end an
    automatic mode early, or weaken it to what still holds, once its cause has been gone
    `rules.calm_s` (`calm`: the evaluator records when it first saw it gone)."""
    current = state.effective()
    trigger = triggered(snapshot, rules, backlog=not backlog_rests(state, snapshot, rules))
    expired = state.mode is not Mode.NORMAL and current is Mode.NORMAL
    if (
        trigger is not None
        and not held(state, snapshot, rules)
        and trigger.mode.rank > current.rank
    ):
        return trigger
    if expired:
        return Change(Mode.NORMAL, f"{state.mode.value} mode ended at its until", None, True)
    calm_s = state.calm_s
    if _calm(state, trigger) and calm_s is not None and calm_s >= rules.calm_s:
        why = f"{current.value} mode lifted: its cause gone for {calm_s:.0f} s"
        if trigger is None:
            return Change(Mode.NORMAL, why, None, True)
        return Change(trigger.mode, f"{why}; {trigger.reason}", trigger.for_s, True)
    return None


def held(state: DegradeState, snapshot: Snapshot, rules: Rules) -> bool:
    """Whether the operator's word holds the automatic triggers back: a mode they set, while
    in force; their lift (normal), until its `until` or, with none, for `rules.calm_s` after
    it (Postgres time). Without it, a cause that outlasts what the operator knows (nodes gone
    for good still count as seen for an hour) degraded again at the next evaluation."""
    if state.automatic:
        return False
    if state.mode is not Mode.NORMAL:
        return state.effective() is not Mode.NORMAL
    if state.version <= 1:
        return False  # the row as its migration left it: nobody lifted anything
    if state.remaining_s is not None:
        return state.remaining_s > 0
    if snapshot.at is None:
        return False  # no clock to judge by
    return (snapshot.at - state.since).total_seconds() < rules.calm_s


def calm(state: DegradeState, snapshot: Snapshot, rules: Rules) -> bool:
    """Whether an automatic mode is in force whose cause is gone: no trigger as strong holds."""
    return _calm(state, triggered(snapshot, rules, not backlog_rests(state, snapshot, rules)))


def _calm(state: DegradeState, trigger: Change | None) -> bool:
    current = state.effective()
    if not state.automatic or current is Mode.NORMAL:
        return False
    return trigger is None or trigger.mode.rank < current.rank
