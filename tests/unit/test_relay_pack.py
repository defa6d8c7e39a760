"""Packing outbox events into messages keeps each task's events in version order."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from uuid import UUID, uuid4

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.fsm import State
from shared.models import Event
from shared.outbox_pack import pack, waves

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def ev(i: int, task: UUID, version: int, state: State) -> Event:
    return Event(
        id=i,
        task_id=task,
        from_status=None,
        to_status=state,
        version=version,
        attempt=0,
        reason="",
        at=NOW,
    )


def flatten(messages: list[tuple[State, list[Event]]]) -> list[Event]:
    out = []
    for state, events in messages:
        assert all(e.to_status is state for e in events)
        out.extend(events)
    return out


def random_events(ids: list[UUID], n: int, rnd: random.Random) -> list[Event]:
    """`n` events of these tasks in random order, each task's in increasing versions."""
    version = dict.fromkeys(ids, 1)
    events = []
    for i in range(n):
        task = rnd.choice(ids)
        version[task] += 1
        events.append(ev(i, task, version[task], rnd.choice(list(State))))
    return events


def test_unrelated_events_share_messages() -> None:
    events = [ev(i, uuid4(), 2, State.PENDING) for i in range(10)]
    assert len(pack(events)) == 1


def test_one_task_across_states_keeps_order() -> None:
    a, b = uuid4(), uuid4()
    events = [
        ev(1, a, 2, State.READY),
        ev(2, b, 2, State.SCHEDULING),
        ev(3, b, 3, State.READY),
        ev(4, a, 3, State.SCHEDULING),
    ]
    messages = pack(events)
    order = {e.id: i for i, (_, batch) in enumerate(messages) for e in batch}
    assert order[1] <= order[4]
    assert order[2] < order[3]


def test_message_size_is_capped() -> None:
    events = [ev(i, uuid4(), 2, State.PENDING) for i in range(25)]
    assert [len(b) for _, b in pack(events, max_per_message=10)] == [10, 10, 5]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 60), st.randoms())
def test_per_task_order_survives_packing(tasks: int, n: int, rnd: random.Random) -> None:
    ids = [uuid4() for _ in range(tasks)]
    events = random_events(ids, n, rnd)
    sent = flatten(pack(events, max_per_message=rnd.randint(1, 10)))
    assert sorted(e.id for e in sent) == list(range(n))
    for task in ids:
        versions = [e.version for e in sent if e.task_id == task]
        assert versions == sorted(versions)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 60), st.randoms())
def test_waves_never_let_a_later_event_of_a_task_overtake(
    tasks: int, n: int, rnd: random.Random
) -> None:
    """A wave's messages are in flight together and a wave goes out only once the one before it
    is confirmed: so no task may be in two messages of a wave, and each task's events must sit
    in waves in version order (a refused message then holds back its tasks' later events)."""
    ids = [uuid4() for _ in range(tasks)]
    events = random_events(ids, n, rnd)
    messages = pack(events, max_per_message=rnd.randint(1, 10))
    sent = waves(messages)
    assert sorted(e.id for wave in sent for _, batch in wave for e in batch) == list(range(n))
    wave_of: dict[UUID, list[tuple[int, int]]] = {task: [] for task in ids}
    for level, wave in enumerate(sent):
        for task in ids:  # at most one message of a wave holds a task
            assert sum(any(e.task_id == task for e in b) for _, b in wave) <= 1
        for _, batch in wave:
            for e in batch:
                wave_of[e.task_id].append((e.version, level))
    for task, seen in wave_of.items():
        by_version = [level for _, level in sorted(seen)]
        assert by_version == sorted(by_version), task
