"""The task lifecycle: states, the transition table as data, and the one way to apply a move.

Every state change in sked is planned here (`plan`: find the rule, check its guard, derive the
fields the move changes) and written by the CAS repository (`apply`: side effect first, then CAS).
The table below is the only place the rules live; `mermaid()` draws it for docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol
from uuid import UUID

from shared.errors import IllegalTransition, StaleWrite, UnknownState


class State(StrEnum):
    CREATED = "created"
    PENDING = "pending"
    READY = "ready"
    SCHEDULING = "scheduling"
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"
    RETRY_WAIT = "retry_wait"
    LOST = "lost"
    TIMED_OUT = "timed_out"
    PAUSED = "paused"
    CANCELED = "canceled"
    SKIPPED = "skipped"

    @classmethod
    def parse(cls, value: object) -> State:
        """Accept a stored value ('retry_wait') or a display name ('RetryWait'), case-blind."""
        if isinstance(value, State):
            return value
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            for state in cls:
                if key in (state.value, state.label.lower()):
                    return state
        raise UnknownState(value, [s.label for s in cls])

    @property
    def label(self) -> str:
        """The display name used in the brief, the docs and the CLI: RetryWait, TimedOut."""
        return "".join(part.capitalize() for part in self.value.split("_"))


S = State

# Success, Canceled and Skipped end a task outright. Failed and TimedOut end it only once its
# retries are spent; until then their one way on is RetryWait (the guard below decides).
ALWAYS_TERMINAL = frozenset({S.SUCCESS, S.CANCELED, S.SKIPPED})
_RETRYABLE = (S.FAILED, S.TIMED_OUT)  # a tuple: the diagram must not depend on hash order
RETRYABLE = frozenset(_RETRYABLE)
# Every state a move can end a task in (is_terminal, whichever the retries left).
ENDING = ALWAYS_TERMINAL | RETRYABLE
# An attempt holds its node's slot and resources, and its workflow resources, in these states.
HOLDS_SLOT = frozenset({S.SCHEDULING, S.RUNNING})
# A task waits for its attempt to start in these states: its schedule timeout counts here.
AWAITS_START = frozenset({S.READY, S.SCHEDULING})
# A move into one of these, made by someone else, takes a running attempt away from its node
# (an operator's pause or cancel, a loss declared and retried): its executor must stop it.
# Such moves are also told on a channel of their own (store.TAKEN_CHANNEL).
TAKES_AWAY = frozenset({S.PAUSED, S.CANCELED, S.LOST, S.RETRY_WAIT})


@dataclass(frozen=True)
class Rule:
    source: State
    target: State
    trigger: str
    # Guard: the move is legal only while the task has a retry left (retry_count < max_retries).
    needs_retry: bool = False
    # Derived changes, applied by `plan` so that no caller can forget them.
    new_attempt: bool = False  # a fresh attempt number fences everything the old one writes
    spends_retry: bool = False  # retry_count += 1
    # retry_count = max_retries: a failure that is final at once (no attempt to retry)
    ends_retries: bool = False
    # Guard: legal only while the task has a launch failure left (launch_failures <
    # max_launch_failures); the move counts one (launch_failures += 1).
    spends_launch: bool = False


def _rules(sources: Iterable[State], target: State, trigger: str, **kw: bool) -> list[Rule]:
    return [Rule(src, target, trigger, **kw) for src in sources]


_NON_TERMINAL_LIVE = (S.CREATED, S.PENDING, S.READY, S.SCHEDULING, S.RUNNING, S.RETRY_WAIT, S.LOST)

TRANSITIONS: tuple[Rule, ...] = (
    Rule(S.CREATED, S.PENDING, "accepted"),
    Rule(S.PENDING, S.READY, "dependencies met"),
    Rule(S.PENDING, S.SKIPPED, "dependency condition can no longer hold"),
    Rule(
        S.PENDING,
        S.FAILED,
        "a dependency timed out (policy fail), or inputs too large",
        ends_retries=True,
    ),
    Rule(S.READY, S.SCHEDULING, "picked and placed", new_attempt=True),
    # the schedule timeout (TaskSpec.schedule_timeout_s): not started in time, final at once
    Rule(S.READY, S.FAILED, "not started within its schedule timeout", ends_retries=True),
    Rule(S.SCHEDULING, S.RUNNING, "executor started the attempt"),
    Rule(S.SCHEDULING, S.READY, "dispatch failed or never started"),
    Rule(S.SCHEDULING, S.FAILED, "not started within its schedule timeout", ends_retries=True),
    Rule(S.RUNNING, S.SUCCESS, "attempt succeeded"),
    Rule(S.RUNNING, S.FAILED, "attempt failed"),
    Rule(S.RUNNING, S.TIMED_OUT, "ran past its run timeout"),
    Rule(S.RUNNING, S.LOST, "heartbeats stopped, loss confirmed"),
    # a launch failure (unschedulable, image pull back-off): the attempt never ran, so no
    # retry is spent; at most max_launch_failures times, then Running -> Failed with the reason
    Rule(S.RUNNING, S.READY, "never started (launch failure)", spends_launch=True),
    Rule(S.LOST, S.SUCCESS, "backend reports the job succeeded"),
    Rule(S.LOST, S.FAILED, "backend reports failure, or retries spent"),
    Rule(S.LOST, S.RETRY_WAIT, "retry after loss", needs_retry=True, spends_retry=True),
    Rule(S.FAILED, S.RETRY_WAIT, "retry", needs_retry=True, spends_retry=True),
    Rule(S.TIMED_OUT, S.RETRY_WAIT, "retry", needs_retry=True, spends_retry=True),
    Rule(S.RETRY_WAIT, S.READY, "backoff elapsed"),
    Rule(S.PAUSED, S.PENDING, "resumed"),
    Rule(S.PAUSED, S.CANCELED, "canceled by operator"),
    *_rules(_NON_TERMINAL_LIVE, S.PAUSED, "paused by operator"),
    *_rules(_NON_TERMINAL_LIVE, S.CANCELED, "canceled by operator"),
    *_rules(_RETRYABLE, S.PAUSED, "paused by operator", needs_retry=True),
    *_rules(_RETRYABLE, S.CANCELED, "canceled by operator", needs_retry=True),
)

_BY_PAIR: dict[tuple[State, State], Rule] = {}
for _rule in TRANSITIONS:
    assert (_rule.source, _rule.target) not in _BY_PAIR, f"duplicate rule {_rule}"
    _BY_PAIR[(_rule.source, _rule.target)] = _rule


class TaskView(Protocol):
    """What the FSM needs to know of a task: a snapshot read from the repository."""

    @property
    def id(self) -> UUID: ...
    @property
    def status(self) -> State: ...
    @property
    def version(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def retry_count(self) -> int: ...
    @property
    def max_retries(self) -> int: ...
    @property
    def launch_failures(self) -> int: ...
    @property
    def max_launch_failures(self) -> int: ...


@dataclass(frozen=True)
class Newborn:
    """A task as the statement creating it will leave it (`walk`'s last state, at the
    version its steps give it): what a move planned into that same statement starts from.
    It has no attempt and has spent nothing."""

    id: UUID
    status: State
    version: int
    max_retries: int
    max_launch_failures: int
    attempt: int = 0
    retry_count: int = 0
    launch_failures: int = 0


def walked_version(path: Sequence[State]) -> int:
    """The version of a task created (version 1) and walked along `path` by the same
    statement (`walk`): one more per step."""
    return len(path) + 1


def has_retry_left(task: TaskView) -> bool:
    return task.retry_count < task.max_retries


def has_launch_left(task: TaskView) -> bool:
    return task.launch_failures < task.max_launch_failures


def is_terminal(state: State, retry_left: bool) -> bool:
    """Terminal: never moves again. Failed and TimedOut are terminal once retries are spent."""
    return state in ALWAYS_TERMINAL or (state in RETRYABLE and not retry_left)


def targets(state: State) -> list[State]:
    """Every state the table lets `state` move to (ignoring guards)."""
    return [r.target for r in TRANSITIONS if r.source is state]


def rule_for(source: object, target: object) -> Rule:
    """The rule for source -> target, or IllegalTransition naming both states."""
    src, dst = State.parse(source), State.parse(target)
    rule = _BY_PAIR.get((src, dst))
    if rule is None:
        why = "terminal state" if src in ALWAYS_TERMINAL else "no such rule"
        raise IllegalTransition(src.label, dst.label, why)
    return rule


# Fields a move may set besides status; the repository maps each to a column.
PATCHABLE = frozenset(
    {
        "node",
        "attempt",
        "retry_count",
        "retry_in_s",  # RetryWait: Postgres sets next_retry_at = now() + this (one clock)
        "result",
        "error",
        "log_tail",
        "inputs",
        "paused_by",
        "paused_reason",
        "lease_owner",  # -> Running: the executor incarnation whose lease the attempt holds
        "launch_failures",
    }
)


@dataclass(frozen=True)
class Move:
    """One planned CAS: task `task_id` at `version` goes `source` -> `target`."""

    task_id: UUID
    version: int
    source: State
    target: State
    reason: str
    patch: Mapping[str, Any] = field(default_factory=dict)
    # whether the statement returns the task's row after the move: a caller that needs only
    # to know that it moved (an attempt's end) spares Postgres and itself the row (~15 µs)
    read_back: bool = True


def plan(
    task: TaskView, target: object, reason: str = "", *, read_back: bool = True, **changes: Any
) -> Move:
    """Check the move against the table and its guard; derive attempt and retry bookkeeping.
    `read_back`: whether the statement returns the moved row (`Move.read_back`).

    Raises IllegalTransition (naming both states) before anything is written.
    """
    rule = rule_for(task.status, target)
    if rule.needs_retry and not has_retry_left(task):
        raise IllegalTransition(
            rule.source.label,
            rule.target.label,
            f"retries spent ({task.retry_count}/{task.max_retries}): terminal",
        )
    if rule.spends_launch and not has_launch_left(task):
        raise IllegalTransition(
            rule.source.label,
            rule.target.label,
            f"launch failures spent ({task.launch_failures}/{task.max_launch_failures})",
        )
    unknown = set(changes) - PATCHABLE
    if unknown:
        raise ValueError(f"a transition cannot set {sorted(unknown)}")
    patch = dict(changes)
    if rule.new_attempt:
        patch["attempt"] = task.attempt + 1
    if rule.spends_retry:
        patch["retry_count"] = task.retry_count + 1
    if rule.ends_retries:
        patch["retry_count"] = task.max_retries
    if rule.spends_launch:
        patch["launch_failures"] = task.launch_failures + 1
    return Move(
        task.id, task.version, rule.source, rule.target, reason or rule.trigger, patch, read_back
    )


def walk(start: State, path: Sequence[State]) -> tuple[list[str | None], list[str], list[str]]:
    """The steps of a brand-new task entering at `start` and moving along `path`, each
    checked against the table, as (from states, to states, reasons) for the repository.

    Only for a task created by the same statement: it has no attempt and no retries spent,
    so no guard can refuse, and no other writer can hold it.
    """
    froms: list[str | None] = [None]
    tos, reasons = [start.value], ["submitted"]
    current = start
    for target in path:
        rule = rule_for(current, target)
        derived = rule.new_attempt or rule.spends_retry or rule.ends_retries or rule.spends_launch
        if rule.needs_retry or derived:
            raise IllegalTransition(current.label, target.label, "not a step of admission")
        froms.append(current.value)
        tos.append(rule.target.value)
        reasons.append(rule.trigger)
        current = rule.target
    return froms, tos, reasons


class MoveStore(Protocol):
    """The CAS half of a transition: the repository implements it."""

    async def transition(self, move: Move) -> Any | None: ...


SideEffect = Callable[[], Awaitable[object]]


async def apply(
    store: MoveStore,
    task: TaskView,
    target: object,
    *,
    reason: str = "",
    effect: SideEffect | None = None,
    **changes: Any,
) -> Any:
    """The one way to change a task's state: rule, then side effect, then CAS.

    An illegal move raises IllegalTransition and runs nothing. If the side effect raises, the
    error propagates and the state does not change. A lost CAS raises StaleWrite.
    """
    move = plan(task, target, reason, **changes)
    if effect is not None:
        await effect()
    moved = await store.transition(move)
    if moved is None:
        raise StaleWrite(f"task {task.id} moved on from version {task.version}")
    return moved


def mermaid() -> str:
    """The state diagram of TRANSITIONS, as Mermaid source for docs/architecture.md."""
    lines = ["stateDiagram-v2", "    [*] --> Created"]
    for rule in TRANSITIONS:
        guard = (
            " (retry left)"
            if rule.needs_retry
            else " (no retry)"
            if rule.ends_retries
            else " (launch failure left)"
            if rule.spends_launch
            else ""
        )
        lines.append(f"    {rule.source.label} --> {rule.target.label}: {rule.trigger}{guard}")
    for state in (*sorted(ALWAYS_TERMINAL), *sorted(RETRYABLE)):
        note = "" if state in ALWAYS_TERMINAL else " (retries spent)"
        lines.append(f"    {state.label} --> [*]{': terminal' + note if note else ''}")
    return "\n".join(lines) + "\n"


DIAGRAM_BEGIN = "<!-- fsm-diagram:begin (generated by `sked diagram --write`; do not edit) -->"
DIAGRAM_END = "<!-- fsm-diagram:end -->"


def embed_diagram(document: str) -> str:
    """`document` with the text between the diagram markers replaced by the current diagram."""
    try:
        head, rest = document.split(DIAGRAM_BEGIN, 1)
        _, tail = rest.split(DIAGRAM_END, 1)
    except ValueError:
        raise ValueError(f"the document has no {DIAGRAM_BEGIN!r} … {DIAGRAM_END!r} block") from None
    return f"{head}{DIAGRAM_BEGIN}\n```mermaid\n{mermaid()}```\n{DIAGRAM_END}{tail}"
