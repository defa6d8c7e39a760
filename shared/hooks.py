"""Seams where observers plug in — tracing and metrics — so that neither is woven into
the store, the scheduler or the executor. A hook implements the calls it cares about (the
base class does nothing); `install` adds one; the code at each seam calls the module functions
below, which cost one empty-list check when nothing is installed.

An observer's failure is its own: each call is isolated (`_guarded`), logged (throttled: a
broken exporter fails on every call) and otherwise ignored. A seam runs after a commit or
around an attempt, so an exception let through would report a committed move as failed, hide
it from the other hooks, or leave an attempt that never ends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

from shared.errors import one_line
from shared.throttle import Throttled

if TYPE_CHECKING:
    from shared.fsm import Move
    from shared.models import Task

# What `transitions` may read of a moved task whose move did not ask for its row back
# (fsm.Move.read_back): the statement reads these columns back for the hooks and no more, so
# that metrics or tracing do not bring back the whole rows the callers did without (the
# fragment task_columns_at, level 1; tests/unit/test_queries.py holds the two equal).
SEEN = frozenset(
    {
        *("id", "status", "version", "attempt", "node"),  # what every move reads back
        *("name", "traceparent", "created_at", "queued_at", "started_at", "finished_at"),
    }
)


class Attempt:
    """What an attempt's hooks learn while it runs."""

    def ended(self, ok: bool, error: str | None) -> None:
        """The attempt ended (ok, or failed with `error`)."""


class Hook:
    def transitions(self, moved: Sequence[tuple[Task, Move]], start_ns: int, end_ns: int) -> None:
        """Tasks moved by one statement that ran from `start_ns` to `end_ns`: of a task whose
        move did not ask for its row back, the columns in SEEN only (the rest are None)."""

    def received(
        self, queue: str, task_ids: Sequence[UUID], parents: Sequence[str | None]
    ) -> tuple[list[str | None], list[Any]]:
        """Submissions taken from `queue`, with the trace contexts they came with. Returns
        the contexts to store with the tasks (a hook may start traces), and handles to end
        once they are admitted."""
        return list(parents), []

    def dispatching(self, tasks: Sequence[Task]) -> tuple[list[dict[str, Any]], list[Any]]:
        """Dispatch messages about to go out: headers for each, and handles to end once sent."""
        return [{} for _ in tasks], []

    def finished(self, handles: Sequence[Any]) -> None:
        """End what `received` or `dispatching` started."""

    @contextlib.contextmanager
    def attempt(
        self, task: Task, node: str, headers: Mapping[str, Any] | None
    ) -> Iterator[Attempt]:
        """Around one attempt's run on `node` (the dispatch's headers, if any)."""
        yield Attempt()

    def dispatch_pass(self, seconds: float, placed: int) -> None:
        """One dispatch pass took `seconds` and placed `placed` tasks."""

    def heartbeats(self, result: str, n: int) -> None:
        """`n` heartbeats met `result`: accepted, refused, shed, or stale (see shared.metrics)."""

    def refused(self, n: int) -> None:
        """Intake dead-lettered `n` submissions (to sked.dead, each with its reason)."""

    def purged(self, n: int) -> None:
        """Retention deleted `n` finished tasks."""


installed: list[Hook] = []

log = logging.getLogger(__name__)
_failing = Throttled(log)
R = TypeVar("R")


def _guarded(instead: R, call: Callable[..., R], *args: Any) -> R:
    """`call(*args)`, a hook's method; `instead` if it raises (logged, throttled)."""
    try:
        return call(*args)
    except Exception as exc:
        hook = type(getattr(call, "__self__", call)).__name__
        _failing.warning("hook %s failed (ignored): %s", hook, one_line(exc))
        return instead


def install(hook: Hook) -> None:
    installed.append(hook)


# Inside a store transaction, the moves it made are told once it commits, and never if it
# rolls back (shared.store.Store.transaction): a refused workflow's rolled-back tasks were
# counted in sked_transitions_total and traced as if they existed.
_held: ContextVar[list[tuple[Sequence[tuple[Task, Move]], int, int]] | None] = ContextVar(
    "sked_hooks_held", default=None
)


def transitions(moved: Sequence[tuple[Task, Move]], start_ns: int, end_ns: int) -> None:
    held = _held.get()
    if held is not None:
        held.append((moved, start_ns, end_ns))
        return
    for hook in installed:
        _guarded(None, hook.transitions, moved, start_ns, end_ns)


@contextlib.contextmanager
def told_on_commit() -> Iterator[None]:
    """Around a transaction: the transitions told inside are held, and told once the body
    ends without an exception (the transaction committed); dropped when it raises."""
    held: list[tuple[Sequence[tuple[Task, Move]], int, int]] = []
    token = _held.set(held)
    try:
        yield
    finally:
        _held.reset(token)
    for moved, start_ns, end_ns in held:
        transitions(moved, start_ns, end_ns)


def received(
    queue: str, task_ids: Sequence[UUID], parents: Sequence[str | None]
) -> tuple[list[str | None], list[Any]]:
    contexts: list[str | None] = list(parents)
    handles: list[Any] = []
    for hook in installed:
        theirs = _answer(hook, _guarded(None, hook.received, queue, task_ids, contexts), task_ids)
        if theirs is not None:
            contexts, more = theirs
            handles.extend(more)
    return contexts, handles


def _answer(hook: Hook, given: Any, asked: Sequence[Any]) -> tuple[list[Any], list[Any]] | None:
    """A seam's answer, `(one item per task, handles)`, if it is that shape; else None, the
    hook's failure logged: an answer of another length once made every task of a batch
    fail its admission (a NULL id), or a committed pass send no dispatch."""
    ok = isinstance(given, tuple) and len(given) == 2 and isinstance(given[0], list)
    if ok and len(given[0]) == len(asked) and isinstance(given[1], list):
        return given[0], given[1]
    if given is not None:
        _failing.warning(
            "hook %s failed (ignored): an answer of another shape", type(hook).__name__
        )
    return None


def _overriding(name: str) -> list[Hook]:
    """The installed hooks that implement `name` (the base class's does nothing): a seam run
    per task or per attempt skips the others, such as metrics at an attempt's start."""
    base = getattr(Hook, name)
    return [hook for hook in installed if getattr(type(hook), name) is not base]


def dispatching(tasks: Sequence[Task]) -> tuple[list[dict[str, Any]], list[Any]]:
    headers: list[dict[str, Any]] = [{} for _ in tasks]
    handles: list[Any] = []
    for hook in _overriding("dispatching"):
        given = _answer(hook, _guarded(None, hook.dispatching, tasks), tasks)
        if given is None:
            continue
        more_headers, more = given
        if not all(isinstance(theirs, dict) for theirs in more_headers):
            _failing.warning("hook %s failed (ignored): headers not maps", type(hook).__name__)
            continue
        for mine, theirs in zip(headers, more_headers, strict=True):
            mine.update(theirs)
        handles.extend(more)
    return headers, handles


def finished(handles: Sequence[Any]) -> None:
    if handles:
        for hook in installed:
            _guarded(None, hook.finished, handles)


class _Attempts(Attempt):
    def __init__(self, parts: list[Attempt]) -> None:
        self.parts = parts

    def ended(self, ok: bool, error: str | None) -> None:
        for part in self.parts:
            _guarded(None, part.ended, ok, error)


class _Around(contextlib.AbstractContextManager[Attempt]):
    """One hook's context around an attempt, isolated: a hook that fails to enter it is left
    out (its part an Attempt that observes nothing); one that fails on leaving it is logged.
    Never suppresses what the attempt itself raised."""

    def __init__(self, hook: Hook, task: Task, node: str, headers: Mapping[str, Any] | None):
        self.hook, self.task, self.node, self.headers = hook, task, node, headers
        self.inner: contextlib.AbstractContextManager[Attempt] | None = None

    def __enter__(self) -> Attempt:
        return _guarded(Attempt(), self._enter)

    def _enter(self) -> Attempt:
        inner = self.hook.attempt(self.task, self.node, self.headers)
        part = inner.__enter__()
        self.inner = inner
        return part

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        inner = self.inner
        if inner is not None:
            _guarded(None, inner.__exit__, kind, exc, tb)


# What an attempt gets with no hook installed: one shared context that does nothing. Building
# the generator, the exit stack and the list for every attempt cost ~3 µs of an executor's CPU
# an attempt, to observe nothing.
_UNSEEN: contextlib.nullcontext[Attempt] = contextlib.nullcontext(Attempt())


def attempt(
    task: Task, node: str, headers: Mapping[str, Any] | None
) -> contextlib.AbstractContextManager[Attempt]:
    if not installed:
        return _UNSEEN
    around = _overriding("attempt")
    if not around:  # metrics alone: nothing to do around an attempt
        return _UNSEEN
    return _attempts(around, task, node, headers)


@contextlib.contextmanager
def _attempts(
    around: list[Hook], task: Task, node: str, headers: Mapping[str, Any] | None
) -> Iterator[Attempt]:
    with contextlib.ExitStack() as stack:
        yield _Attempts([stack.enter_context(_Around(h, task, node, headers)) for h in around])


def dispatch_pass(seconds: float, placed: int) -> None:
    for hook in installed:
        _guarded(None, hook.dispatch_pass, seconds, placed)


def heartbeats(result: str, n: int) -> None:
    if n:
        for hook in installed:
            _guarded(None, hook.heartbeats, result, n)


def refused(n: int) -> None:
    if n:
        for hook in installed:
            _guarded(None, hook.refused, n)


def purged(n: int) -> None:
    if n:
        for hook in installed:
            _guarded(None, hook.purged, n)
