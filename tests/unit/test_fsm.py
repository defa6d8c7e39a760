"""The FSM, checked over every (state, target) pair and by random walks (hypothesis)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from uuid import UUID, uuid4

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import fsm
from shared.errors import IllegalTransition, UnknownState
from shared.fsm import ALWAYS_TERMINAL, RETRYABLE, State

ROOT = Path(__file__).resolve().parents[2]
ONE = UUID(int=1)
TABLE = {(r.source, r.target) for r in fsm.TRANSITIONS}


@dataclass(frozen=True)
class Snap:
    """A task snapshot as the FSM sees it."""

    status: State
    version: int = 1
    attempt: int = 0
    retry_count: int = 0
    max_retries: int = 0
    id: UUID = ONE
    launch_failures: int = 0
    max_launch_failures: int = 3


@pytest.mark.parametrize("source", list(State))
@pytest.mark.parametrize("target", list(State))
def test_every_pair(source: State, target: State) -> None:
    task = Snap(source, max_retries=5)
    if (source, target) in TABLE:
        move = fsm.plan(task, target)
        assert (move.source, move.target) == (source, target)
    else:
        with pytest.raises(IllegalTransition) as err:
            fsm.plan(task, target)
        assert source.label in str(err.value)
        assert target.label in str(err.value)


def test_terminal_states_have_no_exits() -> None:
    for state in ALWAYS_TERMINAL:
        assert fsm.targets(state) == []
    for state in RETRYABLE:
        spent = Snap(state, retry_count=2, max_retries=2)
        assert fsm.is_terminal(state, fsm.has_retry_left(spent))
        for target in State:
            with pytest.raises(IllegalTransition):
                fsm.plan(spent, target)


def test_a_launch_failure_goes_back_to_ready_without_spending_a_retry_up_to_its_cap() -> None:
    move = fsm.plan(Snap(State.RUNNING, attempt=2, retry_count=1, max_retries=1), State.READY)
    assert move.patch == {"launch_failures": 1}  # retry_count untouched, attempt kept
    spent = Snap(State.RUNNING, launch_failures=3, max_launch_failures=3)
    with pytest.raises(IllegalTransition, match="launch failures spent"):
        fsm.plan(spent, State.READY)


def test_running_is_entered_only_from_scheduling() -> None:
    assert {r.source for r in fsm.TRANSITIONS if r.target is State.RUNNING} == {State.SCHEDULING}
    assert {r.source for r in fsm.TRANSITIONS if r.target is State.SCHEDULING} == {State.READY}


def test_every_state_is_reachable_and_can_end() -> None:
    seen = {State.CREATED}
    frontier = [State.CREATED]
    while frontier:
        for nxt in fsm.targets(frontier.pop()):
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(State)
    for state in State:
        assert fsm.targets(state) or state in ALWAYS_TERMINAL


def test_parse_names() -> None:
    assert State.parse("RetryWait") is State.RETRY_WAIT
    assert State.parse("retry_wait") is State.RETRY_WAIT
    assert State.parse("timed-out") is State.TIMED_OUT
    with pytest.raises(UnknownState, match=r"'exploded'.*RetryWait"):
        State.parse("exploded")
    with pytest.raises(UnknownState):
        State.parse(3)


def test_plan_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="status"):
        fsm.plan(Snap(State.CREATED), State.PENDING, status="ready")


def test_plan_derives_attempt_and_retry() -> None:
    assert fsm.plan(Snap(State.READY, attempt=3), State.SCHEDULING).patch == {"attempt": 4}
    move = fsm.plan(Snap(State.FAILED, retry_count=1, max_retries=3), State.RETRY_WAIT)
    assert move.patch == {"retry_count": 2}


def test_a_dependency_timeout_failure_is_final_at_once() -> None:
    failed = fsm.plan(Snap(State.PENDING, max_retries=3), State.FAILED)
    assert failed.patch == {"retry_count": 3}
    assert fsm.is_terminal(
        State.FAILED, fsm.has_retry_left(Snap(State.FAILED, retry_count=3, max_retries=3))
    )


@pytest.mark.parametrize("source", sorted(fsm.AWAITS_START))
def test_a_schedule_timeout_failure_is_final_at_once(source: State) -> None:
    """Ready or Scheduling -> Failed (not started in time) spends every retry left."""
    failed = fsm.plan(Snap(source, retry_count=1, max_retries=3), State.FAILED)
    assert failed.patch == {"retry_count": 3}
    assert "schedule timeout" in failed.reason
    assert fsm.rule_for(source, State.FAILED).ends_retries


def _apply(task: Snap, move: fsm.Move) -> Snap:
    return replace(
        task,
        status=move.target,
        version=task.version + 1,
        attempt=move.patch.get("attempt", task.attempt),
        retry_count=move.patch.get("retry_count", task.retry_count),
    )


@settings(max_examples=400, deadline=None)
@given(
    max_retries=st.integers(0, 3),
    requests=st.lists(st.sampled_from(list(State)), max_size=80),
)
def test_random_walks_stay_in_the_table(max_retries: int, requests: list[State]) -> None:
    task = Snap(State.CREATED, max_retries=max_retries, id=uuid4())
    path = [task.status]
    for target in requests:
        terminal = fsm.is_terminal(task.status, fsm.has_retry_left(task))
        try:
            move = fsm.plan(task, target)
        except IllegalTransition:
            continue
        assert not terminal, f"{task.status} is terminal but moved to {target}"
        assert (task.status, target) in TABLE
        nxt = _apply(task, move)
        assert nxt.attempt >= task.attempt
        assert nxt.retry_count <= max_retries
        if target is State.RUNNING:
            assert task.status is State.SCHEDULING
        if target is State.SCHEDULING:
            assert nxt.attempt == task.attempt + 1
        task = nxt
        path.append(task.status)
    # after any RetryWait, Running is reached again only via Ready -> Scheduling
    for i, state in enumerate(path):
        if state is State.RETRY_WAIT and State.RUNNING in path[i:]:
            j = path.index(State.RUNNING, i)
            assert path[j - 2 : j] == [State.READY, State.SCHEDULING]


def test_architecture_doc_holds_the_current_diagram() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text("utf-8")
    assert fsm.embed_diagram(doc) == doc, "run `sked diagram --write` and commit the result"


def test_doc_check_fails_on_a_stale_diagram() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text("utf-8")
    stale = doc.replace("Running --> Lost", "Running --> Gone")
    assert stale != doc
    assert fsm.embed_diagram(stale) != stale
