"""The follower's decisions (services/scheduler/follow.py), on the in-memory store: an
admission's placements told to their nodes by its commit get their dispatch messages only if
still unclaimed once the wait is over; Postgres away keeps them; a node given more than a
notification lists gets its message at once. (On the real servers: tests/integration/
test_dispatch_follow.py.)"""

from __future__ import annotations

import asyncio
from uuid import uuid4

import pytest

from services.scheduler.dispatch import Dispatcher
from services.scheduler.follow import told
from services.scheduler.hub import Hub
from services.scheduler.intake import Intake
from shared.dispatches import MAX_PLACED
from shared.fsm import State
from shared.models import Task
from shared.settings import Settings
from tests.fakes import FakeReadyQueue, InMemoryStore, StubBus, new_task, submission
from tests.helpers import spec
from tests.unit.test_decisions import dispatched

SETTINGS = Settings(heartbeat_secret="unit-test-secret-0123456789", dispatch_follow_s=0.5)


def intake_on(store: InMemoryStore, settings: Settings = SETTINGS) -> tuple[Intake, StubBus]:
    queue, bus, hub = FakeReadyQueue(), StubBus(), Hub()
    dispatcher = Dispatcher(settings, store, bus, queue, hub)  # type: ignore[arg-type]
    return Intake(settings, store, bus, queue, hub, dispatcher), bus  # type: ignore[arg-type]


async def test_a_placement_claimed_from_its_notification_gets_no_dispatch_message() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=4)
    intake, bus = intake_on(store)
    claimed, unclaimed = await intake.accept([submission("x"), submission("y")])  # type: ignore[list-item]
    assert {claimed.status, unclaimed.status} == {State.SCHEDULING}
    assert bus.published == []  # held for the follower, not sent with the placement
    assert len(intake.follower) == 2
    # the node's executor claims one from the notification; the other is not heard
    await store.walk(await store.tasks.get(claimed.id), State.RUNNING, lease_owner=str(uuid4()))
    assert await intake.follower.send_due(None) == 1
    assert [d.task_id for d in dispatched(bus)] == [unclaimed.id]
    assert len(intake.follower) == 0
    assert await intake.follower.send_due(None) == 0  # each placement followed once


async def test_only_what_came_due_is_looked_at() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=4)
    intake, bus = intake_on(store)
    [task] = await intake.accept([submission("x")])  # type: ignore[list-item]
    assert await intake.follower.send_due(0.0) == 0  # placed just now: not due at time 0
    assert len(intake.follower) == 1
    assert bus.published == []
    assert await intake.follower.send_due(None) == 1
    assert [d.task_id for d in dispatched(bus)] == [task.id]


async def test_a_placement_moved_on_or_placed_again_gets_no_message_of_its_old_attempt() -> None:
    """Still Scheduling is not enough: in the attempt and on the node that were placed."""
    store = InMemoryStore()
    store.nodes.add("a", slots=4)
    store.nodes.add("b", slots=4)
    intake, bus = intake_on(store)
    [task] = await intake.accept([submission("x")])  # type: ignore[list-item]
    # handed back and placed again elsewhere before the wait was over: a new attempt
    again = await store.walk(await store.tasks.get(task.id), State.READY)
    await store.walk(again, State.SCHEDULING, node="b" if task.node == "a" else "a")
    assert await intake.follower.send_due(None) == 0
    assert bus.published == []


class Away(InMemoryStore):
    """Postgres away for the follower's read, `failures` times."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        original = self.tasks.still_placed

        async def still_placed(attempts: list[tuple[object, int, str]]) -> set[object]:
            if self.failures:
                self.failures -= 1
                raise ConnectionResetError("Postgres away")
            return await original(attempts)  # type: ignore[arg-type]

        self.tasks.still_placed = still_placed  # type: ignore[assignment, method-assign]


async def test_postgres_away_keeps_the_placements_for_the_next_look() -> None:
    store = Away(failures=1)
    store.nodes.add("a", slots=4)
    intake, bus = intake_on(store)
    [task] = await intake.accept([submission("x")])  # type: ignore[list-item]
    with pytest.raises(ConnectionResetError):
        await intake.follower.send_due(None)
    assert len(intake.follower) == 1  # kept, due at once
    assert await intake.follower.send_due(0.0) == 1
    assert [d.task_id for d in dispatched(bus)] == [task.id]


async def test_the_loop_sends_when_due_and_everything_left_when_stopping() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=4)
    settings = SETTINGS.model_copy(update={"dispatch_follow_s": 0.05})
    intake, bus = intake_on(store, settings)
    stopping = asyncio.Event()
    loop = asyncio.create_task(intake.follower.run(stopping))
    [first] = await intake.accept([submission("x")])  # type: ignore[list-item]
    for _ in range(200):  # bounded: 10 s
        if bus.published:
            break
        await asyncio.sleep(0.05)
    assert [d.task_id for d in dispatched(bus)] == [first.id]
    intake.follower.wait_s = 3600.0  # the next one would wait an hour, but the loop stops
    [second] = await intake.accept([submission("y")])  # type: ignore[list-item]
    stopping.set()
    await asyncio.wait_for(loop, 5)
    assert [d.task_id for d in dispatched(bus)] == [first.id, second.id]


async def test_without_a_wait_dispatches_go_with_their_placement() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=4)
    intake, bus = intake_on(store, SETTINGS.model_copy(update={"dispatch_follow_s": 0.0}))
    [task] = await intake.accept([submission("x")])  # type: ignore[list-item]
    await asyncio.wait_for(asyncio.gather(*intake._sending), 5)
    assert [d.task_id for d in dispatched(bus)] == [task.id]
    assert len(intake.follower) == 0


def placed_on(node: str, n: int) -> list[Task]:
    return [new_task(spec(f"{node}{i}"), status=State.SCHEDULING, node=node) for i in range(n)]


def test_a_node_given_more_than_a_notification_lists_is_told_by_message_alone() -> None:
    few, many = placed_on("a", MAX_PLACED), placed_on("b", MAX_PLACED + 1)
    notified, rest = told(many[:1] + few + many[1:], MAX_PLACED)
    assert [t.node for t in notified] == ["a"] * MAX_PLACED
    assert {t.id for t in rest} == {t.id for t in many}
