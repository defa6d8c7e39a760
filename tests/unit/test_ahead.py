"""Placement planned ahead of an admission (services.scheduler.ahead, and intake's use of it):
the plan is made on a view of the nodes read lately, counting the scheduler's own placements
since; a refused plan costs the task its place in the fast path (it waits in line, and the
view is dropped), never a slot twice."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest import mock
from uuid import UUID, uuid4

from services.scheduler import ahead
from services.scheduler.ahead import NodeView
from services.scheduler.dispatch import Dispatcher
from services.scheduler.hub import Hub
from services.scheduler.intake import ADMISSION, Intake
from services.scheduler.queued import QueuedTasks
from shared.degrade import Mode
from shared.fsm import State
from shared.models import Task
from shared.placement import Need
from shared.settings import Settings
from shared.store import Placing
from tests.fakes import FakeReadyQueue, InMemoryStore, StubBus, new_task, submission
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
    # Not at read_at + VIEW_S exactly: (r + 0.1) - r is 0.09999... for many r, and CI met one.
    with mock.patch.object(ahead.time, "monotonic", return_value=view.read_at + ahead.VIEW_S * 0.9):
        assert view.fresh(0)
    with mock.patch.object(ahead.time, "monotonic", return_value=view.read_at + ahead.VIEW_S * 1.1):
        assert not view.fresh(0)


def parts(store: InMemoryStore) -> tuple[Intake, FakeReadyQueue, Hub]:
    queue, bus, hub = FakeReadyQueue(), StubBus(), Hub()
    dispatcher = Dispatcher(SETTINGS, store, bus, queue, hub)  # type: ignore[arg-type]
    return Intake(SETTINGS, store, bus, queue, hub, dispatcher), queue, hub  # type: ignore[arg-type]


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


# -- tasks kept as they were queued (services/scheduler/queued.py) ----------------------------


async def test_a_pass_places_the_tasks_intake_queued_without_reading_them_again() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=3)
    intake, queue, hub = parts(store)
    await queue.push([await ready_task(store, "ahead")])  # something in line: intake queues
    tasks = await intake.accept([submission("one"), submission("two")])
    assert {t.status for t in tasks} == {State.READY}
    assert len(hub.queued) == 2
    reads = mock.AsyncMock(wraps=store.tasks.get_ready)
    store.tasks.get_ready = reads  # type: ignore[method-assign]
    assert await intake.dispatcher.dispatch_once() == 3
    # only the task queued by someone else is read; intake's two are placed as it kept them
    assert [c.args[0] for c in reads.await_args_list] == [[(await named(store, "ahead")).id]]
    assert len(hub.queued) == 0


async def ready_task(store: InMemoryStore, name: str) -> Task:
    return await store.walk(store.put(new_task(spec(name))), State.PENDING, State.READY)


async def named(store: InMemoryStore, name: str) -> Task:
    return next(t for t in store.data.tasks.values() if t.name == name)


async def test_a_kept_task_that_changed_meanwhile_is_read_again_and_never_lost() -> None:
    """Paused while in line: its kept copy's CAS loses, the pass reads it again and leaves it
    out (it is not Ready). Handed back by another node meanwhile (Ready again, in its place,
    the same score): the kept copy's CAS loses, the task goes back in line, and the next pass
    places it as read afresh."""
    store = InMemoryStore()
    store.nodes.add("a", slots=4)
    intake, queue, hub = parts(store)
    await queue.push([await ready_task(store, "ahead")])
    paused, bounced = await intake.accept([submission("paused"), submission("bounced")])
    await store.walk(paused, State.PAUSED)
    elsewhere = await store.walk(bounced, State.SCHEDULING, node="b")
    await store.walk(elsewhere, State.READY)  # back in line with its queued_at, unstarted
    await queue.pop(10)  # take them out of line as the pass would, then play it:
    await queue.push([await store.tasks.get(i) for i in (bounced.id, paused.id)])
    placed = await intake.dispatcher.dispatch_once()
    assert placed == 0  # both kept copies were stale
    assert (await store.tasks.get(paused.id)).status is State.PAUSED
    assert await queue.pop(10) == [bounced.id]  # back in line, nothing lost
    await queue.push([await store.tasks.get(bounced.id)])
    assert await intake.dispatcher.dispatch_once() == 1
    assert (await store.tasks.get(bounced.id)).status is State.SCHEDULING
    assert len(hub.queued) == 0


def test_only_never_started_tasks_are_kept_and_only_for_the_same_queue_entry() -> None:
    kept = QueuedTasks()
    fresh = new_task(spec("fresh"), status=State.READY, version=3)
    retried = new_task(spec("retried"), status=State.READY, version=9, attempt=2)
    kept.keep([(fresh, 10.0), (retried, 11.0)])
    assert len(kept) == 1  # an earlier attempt's lease could fence the retried one
    known, unknown = kept.take([(fresh.id, 12.5)])  # pushed again since, by anyone
    assert (known, unknown) == ([], [fresh.id])
    kept.keep([(fresh, 10.0)])
    assert kept.take([(fresh.id, 10.0), (retried.id, 11.0)]) == ([fresh], [retried.id])
