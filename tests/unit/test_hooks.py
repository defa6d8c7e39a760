"""The hook seams: each hook is called at the seams it implements, and only those."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from shared import hooks
from shared.task import Task


class _Counting(hooks.Hook):
    """Implements no per-attempt or per-dispatch seam: metrics, say."""

    def __init__(self) -> None:
        self.moves = 0

    def transitions(self, moved: Sequence[Any], start_ns: int, end_ns: int) -> None:
        self.moves += len(moved)


class _Following(hooks.Hook):
    """Implements the attempt and dispatch seams: tracing, say."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @contextlib.contextmanager
    def attempt(
        self, task: Task, node: str, headers: Mapping[str, Any] | None
    ) -> Iterator[hooks.Attempt]:
        self.calls.append(f"enter {node}")
        yield hooks.Attempt()
        self.calls.append(f"exit {node}")

    def dispatching(self, tasks: Sequence[Task]) -> tuple[list[dict[str, Any]], list[Any]]:
        self.calls.append(f"dispatching {len(tasks)}")
        return [{"traceparent": "t"} for _ in tasks], ["handle"]


def test_a_hook_that_does_nothing_around_attempts_costs_an_attempt_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With only hooks that leave the attempt seam alone, an attempt gets the shared no-op
    context (no generator, exit stack or list built per attempt); a hook that implements it
    is entered and left around the attempt, the others still skipped."""
    counting = _Counting()
    monkeypatch.setattr(hooks, "installed", [counting])
    assert hooks.attempt(None, "n1", None) is hooks._UNSEEN  # type: ignore[arg-type]
    following = _Following()
    monkeypatch.setattr(hooks, "installed", [counting, following])
    with hooks.attempt(None, "n2", None) as seen:  # type: ignore[arg-type]
        seen.ended(True, None)
        assert following.calls == ["enter n2"]
    assert following.calls == ["enter n2", "exit n2"]


def test_dispatch_headers_come_from_the_hooks_that_write_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    following = _Following()
    monkeypatch.setattr(hooks, "installed", [_Counting(), following])
    headers, handles = hooks.dispatching([None, None])  # type: ignore[list-item]
    assert headers == [{"traceparent": "t"}, {"traceparent": "t"}]
    assert handles == ["handle"]
    assert following.calls == ["dispatching 2"]
    monkeypatch.setattr(hooks, "installed", [_Counting()])
    assert hooks.dispatching([None]) == ([{}], [])  # type: ignore[list-item]
