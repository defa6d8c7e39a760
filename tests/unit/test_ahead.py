"""Placement planned ahead of an admission (services.scheduler.ahead, and intake's use of it):
the plan is made on a view of the nodes read lately, counting the scheduler's own placements
since; a refused plan costs the task its place in the fast path (it waits in line, and the
view is dropped), never a slot twice."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any
from unittest import mock
from uuid import UUID, uuid4

from services.scheduler import ahead
from services.scheduler.ahead import NodeView
from services.scheduler.dispatch import Dispatcher
from services.scheduler.hub import Hub
from services.scheduler.intake import ADMISSION, Intake
from shared.degrade import Mode
from shared.fsm import State
from shared.placement import Need
from shared.settings import Settings
from shared.store import Placing
from tests.fakes import FakeReadyQueue, InMemoryStore, StubBus, StubMessage
from tests.helpers import spec

SETTINGS = Settings(heartbeat_secret="x" * 32)


async def view_of(store: InMemoryStore, mode: Mode | None = Mode.NORMAL) -> NodeView:
    return NodeView(await store.nodes.all(), mode, 0)


async def test_a_view_plans_new_tasks_as_moves_into_scheduling_on_the_best_nodes() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=2)
    store.nodes.add("b", slots=2, labels={"zone": "eu"})
    view = await view_of(store)
    specs = [spec("any"), spec("eu", selector={"zone": "eu"}), spec("mars", selector={"z": "m"})]
    ids = [uuid4() for _ in specs]
    placing, unplaced, needs = view.plan(specs, ids, ADMISSION, 10.0)
    assert placing is not None
    moves = {m.task_id: m for m in placing.moves}
    assert set(moves) == {ids[0], ids[1]} == set(needs)
    assert all(
        (m.source, m.target, m.version) == (State.READY, State.SCHEDULING, 3)
        for m in moves.values()
    )
    assert moves[ids[1]].patch["node"] == "b"
    assert all(m.patch["attempt"] == 1 for m in moves.values())
    assert set(placing.boot_ids) == {m.patch["node"] for m in moves.values()}
    assert "no node matches selector z=m" in unplaced[ids[2]].reason


def applied(view: NodeView, placing: Placing | None, needs: dict[UUID, Need]) -> str:
    """Tell the view its plan was applied, as intake does with the tasks that moved; returns
    the node of the (one) task planned."""
    assert placing is not None
    moved: Any = [SimpleNamespace(id=m.task_id, node=m.patch["node"]) for m in placing.moves]
    view.placed(moved, needs)
    return str(placing.moves[0].patch["node"])


async def test_a_view_counts_its_own_placements_so_plans_spread_and_stop_at_capacity() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=1)
    store.nodes.add("b", slots=1)
    view = await view_of(store)
    first = applied(view, *view.plan([spec("one")], [uuid4()], ADMISSION, 10.0)[::2])
    second = applied(view, *view.plan([spec("two")], [uuid4()], ADMISSION, 10.0)[::2])
    assert {first, second} == {"a", "b"}  # the second goes where the first is not
    placing, unplaced, _ = view.plan([spec("three")], [tid := uuid4()], ADMISSION, 10.0)
    assert placing is None
    assert unplaced[tid].fits_later  # both full: it waits in line


async def test_a_view_plans_nothing_out_of_normal_mode_and_goes_stale() -> None:
    store = InMemoryStore()
    store.nodes.add("a")
    for mode in (Mode.PARTIAL, Mode.FULL):
        placing, unplaced, _ = (await view_of(store, mode)).plan(
            [spec("t")], [uuid4()], ADMISSION, 10.0
        )
        assert (placing, unplaced) == (None, {})
    view = await view_of(store)
    assert view.fresh(0)
    assert not view.fresh(1)  # a node or the degrade mode changed since
    with mock.patch.object(ahead.time, "monotonic", return_value=view.read_at + ahead.VIEW_S):
        assert not view.fresh(0)


def parts(store: InMemoryStore) -> tuple[Intake, FakeReadyQueue, Hub]:
    queue, bus, hub = FakeReadyQueue(), StubBus(), Hub()
    dispatcher = Dispatcher(SETTINGS, store, bus, queue, hub)  # type: ignore[arg-type]
    return Intake(SETTINGS, store, bus, queue, hub, dispatcher), queue, hub  # type: ignore[arg-type]


def submission(name: str) -> Any:
    job = {"name": name, "job": {"kind": "command", "argv": ["true"]}}
    return StubMessage(json.dumps(job).encode(), "submit", str(uuid4()))


async def test_intake_places_on_a_view_and_keeps_it_for_the_next_submission() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=2)
    intake, queue, hub = parts(store)
    reads = mock.AsyncMock(wraps=store.nodes.read)
    store.nodes.read = reads  # type: ignore[method-assign]
    [one] = await intake.accept([submission("one")])
    [two] = await intake.accept([submission("two")])
    assert [t.status for t in (one, two)] == [State.SCHEDULING] * 2
    assert reads.await_count == 1  # the second planned on the view the first read
    [three] = await intake.accept([submission("three")])  # both slots taken: in line
    assert three.status is State.READY
    assert await queue.pop(5) == [three.id]
    hub.node_notify()  # a node changed: the view is read again
    await intake.accept([submission("four")])
    assert reads.await_count == 2


async def test_a_plan_its_node_refuses_leaves_the_task_in_line_and_drops_the_view() -> None:
    """The node was cordoned after the view was read: the admission's own check refuses the
    plan, the task stays Ready and goes in line (where dispatch finds it), and the next
    admission reads the nodes afresh."""
    store = InMemoryStore()
    store.nodes.add("a", slots=4)
    intake, queue, hub = parts(store)
    await intake.accept([submission("warm")])  # reads the view
    store.nodes.d.nodes["a"] = store.nodes.d.nodes["a"].__class__(
        **{**vars(store.nodes.d.nodes["a"]), "ready": False}
    )
    [task] = await intake.accept([submission("refused")])
    assert (task.status, task.node) == (State.READY, None)
    assert task.id in await queue.pop(5)
    assert hub.dispatch.is_set()  # dispatch is asked to look
    assert intake._view is None
