"""The hook seams (shared.hooks) against real Postgres, Redis and RabbitMQ: an observer that
fails (a tracing exporter's bug, a metrics hook's) must not wedge an attempt nor turn a
committed move into an error."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from shared import fsm, hooks
from shared.client import WaitTimeout
from shared.fsm import State
from shared.settings import Settings
from shared.store import Store
from shared.task import Task
from shared.views import is_done
from tests.helpers import spec
from tests.integration.pipeline import pipeline


class _FailsAroundAttempts(hooks.Hook):
    """A tracing-like hook with a bug: entering an attempt's context raises."""

    def __init__(self) -> None:
        self.entered = 0

    @contextlib.contextmanager
    def attempt(
        self, task: Task, node: str, headers: Mapping[str, Any] | None
    ) -> Iterator[hooks.Attempt]:
        self.entered += 1
        raise RuntimeError("exporter bug")
        yield hooks.Attempt()  # pragma: no cover


class _FailsOnTransitions(hooks.Hook):
    def transitions(self, moved: Sequence[Any], start_ns: int, end_ns: int) -> None:
        raise RuntimeError("metrics bug")


class _Counting(hooks.Hook):
    def __init__(self) -> None:
        self.moves = 0

    def transitions(self, moved: Sequence[Any], start_ns: int, end_ns: int) -> None:
        self.moves += len(moved)


async def test_a_hook_that_raises_around_an_attempt_leaves_the_task_running_for_ever(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler and an executor run in this process with one hook installed whose
    `attempt` context raises on entry (an observer's bug, as an exporter's). A noop handler
    task is submitted. Owed: the attempt still ends (run without the observer, or failed
    with the reason) and the task reaches a terminal state, as Starter._run promises for a
    backend's bug ("must not leave the attempt hanging"). hooks.attempt raised in
    Starter._run before `self.ended` was reached; the asyncio task died with the exception
    unobserved, the attempt stayed in node.active (its lease renewed, its slot held) and the
    task Running for ever. Now each hook's context is isolated (hooks._Around): the attempt
    runs without the failing observer."""
    bad = _FailsAroundAttempts()
    monkeypatch.setattr(hooks, "installed", [bad])
    async with pipeline(settings, tmp_path, "hooked") as (store, client):
        task_id = await client.submit(
            {"name": "hooked", "job": {"kind": "handler", "handler": "tests.e2e.jobs:noop"}}
        )
        with contextlib.suppress(WaitTimeout):  # a noop takes well under 1 s
            await client.wait(task_id, timeout=20)
        seen = await store.tasks.get(task_id)
    assert bad.entered >= 1, "the attempt was never started: the probe did not run"
    assert is_done(seen), f"task still {seen.status.label} 20 s after a failing observer"


async def test_a_hook_that_raises_on_a_committed_move_reports_it_failed_and_blinds_the_rest(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two hooks are installed: one with a bug in `transitions`, then a counting one (the
    metrics). A task's Created -> Pending move is applied through the store. Owed: the move
    is committed, so the caller learns it won (the Task back) and every other hook is told
    of it. TaskStore.transition_many calls hooks.transitions after the statement committed;
    the first hook's exception went to the caller as if the move had failed (a caller that
    retries meets a StaleWrite on its own win) and the later hooks never saw the move. Now
    each hook's call is isolated and logged (hooks._guarded)."""
    task = await store.tasks.create(spec("observed"))
    counting = _Counting()
    monkeypatch.setattr(hooks, "installed", [_FailsOnTransitions(), counting])
    moved: Task | None = None
    error: Exception | None = None
    try:
        moved = await store.tasks.transition(fsm.plan(task, State.PENDING, "probe"))
    except RuntimeError as exc:
        error = exc
    monkeypatch.setattr(hooks, "installed", [])
    after = await store.tasks.get(task.id)
    assert after.status is State.PENDING  # committed either way
    assert error is None, f"the committed move was reported to its caller as {error!r}"
    assert moved is not None
    assert moved.status is State.PENDING
    assert counting.moves == 1, "the metrics hook never saw the committed move"
