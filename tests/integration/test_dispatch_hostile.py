"""The dispatch path against what a review found could idle slots or misplace a task (round
s47): a node relabelled under the same boot id since the plan was read, members naming no task
and fenced tasks at the head of the line, and intake parking a task just after a node joined.
Each test says what the code once did and what it does now."""

from __future__ import annotations

import asyncio
from uuid import UUID, uuid4

import pytest

from services.executor.serving import cluster_owner
from services.scheduler.hub import Hub
from services.scheduler.reconcile import Reconciler
from services.scheduler.service import Scheduler
from shared import control, fsm
from shared.fsm import State
from shared.models import Task
from shared.queues import READY_KEY
from shared.settings import Settings
from shared.store import Placing, Store
from shared.wiring import Backends, backends
from tests.helpers import spec
from tests.integration.test_admit_place import planned

BOUND_S = 30.0

ADMISSION = (State.PENDING, State.READY)
TTL_S = 10.0


async def _queued_task(b: Backends) -> Task:
    """A Ready task in line, the queue marked built (a scheduler then does not rebuild it)."""
    [real] = await b.store.tasks.create_many([spec("real")], walk=(State.PENDING, State.READY))
    await b.ready_queue.push([real])
    await b.ready_queue.mark_built()
    return real


async def test_a_cluster_node_relabelled_since_the_read_takes_a_task_its_labels_refuse(
    store: Store,
) -> None:
    """A cluster node's row is owned by cluster_owner(node id), the same uuid at every
    re-registration: when Kubernetes relabels it (zone a -> b), its boot id stays. sked_admit
    once checked a planned node by boot id and room alone, so an admission planned on the old
    view placed a task whose selector is zone=a on a node now zone=b; now the node's labels,
    read under its lock, must carry every planned task's selector, and the task stays Ready.
    (A dispatch pass reads the labels after its locks: it never had the hole.)"""
    owner = cluster_owner("k1")
    await store.nodes.register("k1", 4, 4.0, 1024, 0, {"zone": "a"}, owner)
    boots = {n.id: n.boot_id for n in await store.nodes.all()}  # the scheduler's view
    # kubectl label node k1 zone=b --overwrite: serving.sync re-registers the offer
    await store.nodes.register("k1", 4, 4.0, 1024, 0, {"zone": "b"}, owner)
    specs = [spec("t", selector={"zone": "a"})]
    ids = [uuid4()]
    placing = Placing(planned(ids, specs, ["k1"]), boots, TTL_S)
    [(task, _)] = await store.tasks.admit_many(specs, ids, ADMISSION, None, placing)
    node = next(n for n in await store.nodes.all() if n.id == "k1")
    assert task.status is State.READY, (
        f"task with selector zone=a is {task.status.label} on {task.node}, "
        f"whose labels are now {dict(node.labels)}"
    )


async def test_a_relabel_that_keeps_the_selector_still_places_the_planned_task(
    store: Store,
) -> None:
    """The check is the selector, not the labels whole: a label the task does not ask for may
    change under the plan and the placement holds."""
    owner = cluster_owner("k1")
    await store.nodes.register("k1", 4, 4.0, 1024, 0, {"zone": "a", "pool": "x"}, owner)
    boots = {n.id: n.boot_id for n in await store.nodes.all()}
    await store.nodes.register("k1", 4, 4.0, 1024, 0, {"zone": "a", "pool": "y"}, owner)
    specs = [spec("t", selector={"zone": "a"}), spec("u")]
    ids = [uuid4(), uuid4()]
    placing = Placing(planned(ids, specs, ["k1", "k1"]), boots, TTL_S)
    admitted = await store.tasks.admit_many(specs, ids, ADMISSION, None, placing)
    assert [t.status for t, _ in admitted] == [State.SCHEDULING, State.SCHEDULING]


async def _node(b, node: str = "n1", slots: int = 2) -> None:  # type: ignore[no-untyped-def]
    await b.bus.declare_node_queue(await b.bus.consumer_channel(1), node)
    await b.store.nodes.register(node, slots, 0.0, 0, 0, {}, uuid4(), prefetch=0)


async def _wait_placed(b, task_id: UUID, seconds: float) -> State:  # type: ignore[no-untyped-def]
    for _ in range(int(seconds * 10)):
        status = (await b.store.tasks.get(task_id)).status
        if status is not State.READY:
            return status
        await asyncio.sleep(0.1)
    return (await b.store.tasks.get(task_id)).status


async def test_foreign_members_at_the_head_of_the_line_idle_the_free_slots(
    settings: Settings,
) -> None:
    """Members that name no task (anyone who can write to Redis) are dropped at the pop. The
    pass that popped them once counted them neither as placed nor as stale, so the loop slept
    a reconcile period after each pass of `free` members: with 2 idle slots and 40 junk members
    ahead, a Ready task waited ~100 s. Now a pop that came back short with nothing put back in
    line runs the next pass at once, and the task is placed within moments."""
    async with backends(settings) as b:
        await _node(b, slots=2)
        redis = b.ready_queue.redis
        await redis.zadd(READY_KEY, {f"junk-{i}": -1e12 + i for i in range(40)})
        real = await _queued_task(b)
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        async with asyncio.timeout(BOUND_S):
            async with scheduler:
                status = await _wait_placed(b, real.id, 6.0)
                left = await b.ready_queue.size()
        assert status is State.SCHEDULING, (
            f"after 6 s with 2 idle slots the Ready task is still {status.label}; "
            f"{left - 1} junk members still ahead of it in sked:ready"
        )


async def test_fenced_tasks_at_the_head_of_the_line_hold_the_free_slots_for_their_lease(
    settings: Settings,
) -> None:
    """A task paused while its executor could not hear it, then resumed, is Ready but fenced
    until its old attempt's lease ends (up to heartbeat_timeout_s). A pass once put it back in
    line, at the head, where every pass popped it again for free slots it could not use: as
    many fenced tasks as free slots idled them for the whole lease. Now it waits aside in
    FENCED_KEY until a task ends, a lease is given back or the reconcile period, and the task
    behind it is placed at once."""
    async with backends(settings) as b:
        await _node(b, "old", slots=2)  # where the fenced tasks ran; it goes silent after
        await _node(b, "n1", slots=2)
        fenced = await b.store.tasks.create_many(
            [spec(f"f{i}", priority=5) for i in range(2)], walk=(State.PENDING, State.READY)
        )
        for t in fenced:
            t = await fsm.apply(b.store.tasks, t, State.SCHEDULING, node="old")
            await fsm.apply(b.store.tasks, t, State.RUNNING, lease_owner=str(uuid4()))
            await control.pause(b.store, t.id, "hold", by="ops")  # unheard: lease kept
            await control.resume(b.store, b.ready_queue, t.id, by="ops")
        real = await _queued_task(b)
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        async with asyncio.timeout(BOUND_S):
            async with scheduler:
                status = await _wait_placed(b, real.id, 8.0)
                heads = await b.ready_queue.redis.zrange(READY_KEY, 0, 1)
        assert status is State.SCHEDULING, (
            f"after 8 s with 2 idle slots on n1 the Ready task is still {status.label}, "
            f"behind fenced tasks {heads} that cannot start for 30 s"
        )


async def test_a_task_intake_parks_just_after_a_node_joins_stays_parked_for_good(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Intake parks, in its own loop, what no node in its view can take; a node joining wakes
    the *dispatch* loop, which unparks. If the node's NOTIFY was handled between intake's read
    of the nodes and its park, the unpark ran on an empty set and the task stayed parked until
    some other node changed, a matching node idle. Now intake's park compares Hub.node_changes
    with the view's and asks for the unpark again: placed well within a reconcile period
    (whose backstop, every PRUNE_S, would bring it back later too)."""
    from shared.store.tasks import Tasks

    async with backends(settings) as b:
        await _node(b, "n1", slots=2)
        await b.bus.declare_node_queue(await b.bus.consumer_channel(1), "gpu1")
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        real = Tasks.admit_many

        async def slow_admit(self, *args, **kw):  # type: ignore[no-untyped-def]
            # the node joins while the admission is in flight; the dispatch loop hears it
            await b.store.nodes.register("gpu1", 2, 0.0, 0, 0, {"kind": "gpu"}, uuid4())
            await asyncio.sleep(0.5)
            return await real(self, *args, **kw)

        async with asyncio.timeout(BOUND_S):
            async with scheduler:
                await asyncio.sleep(0.3)  # set up, queue rebuilt, LISTEN on
                monkeypatch.setattr(Tasks, "admit_many", slow_admit)
                [task], _ = await scheduler.intake.admit(
                    [spec("wants-gpu", selector={"kind": "gpu"})], [uuid4()]
                )
                monkeypatch.setattr(Tasks, "admit_many", real)
                status = await _wait_placed(b, task.id, 3.0)  # < a reconcile period
                depths = await b.ready_queue.depths()
                row = await b.store.tasks.get(task.id)
        assert status is State.SCHEDULING, (
            f"3 s after node gpu1 (kind=gpu, idle) joined, the task is {status.label}: "
            f"{row.status_reason!r}; queue {depths}"
        )


async def test_a_lease_given_back_sends_its_fenced_task_at_once(settings: Settings) -> None:
    """An executor that gives back the lease of a paused attempt (its process gone) once told
    nobody: the fenced task waited for a pass that happened to pop it. Now release_leases
    notifies, the scheduler brings the fenced tasks back, and it is placed well within a
    reconcile period."""
    async with backends(settings) as b:
        await _node(b, "n1", slots=2)
        [t] = await b.store.tasks.create_many([spec("f")], walk=(State.PENDING, State.READY))
        owner = uuid4()
        t = await fsm.apply(b.store.tasks, t, State.SCHEDULING, node="n1")
        await fsm.apply(b.store.tasks, t, State.RUNNING, lease_owner=str(owner))
        await control.pause(b.store, t.id, "hold", by="ops")  # unheard: lease kept
        await control.resume(b.store, b.ready_queue, t.id, by="ops")
        await b.ready_queue.mark_built()
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        async with asyncio.timeout(BOUND_S):
            async with scheduler:
                for _ in range(100):  # the first pass sets it aside
                    if (await b.ready_queue.depths())["fenced"]:
                        break
                    await asyncio.sleep(0.05)
                row = await b.store.tasks.get(t.id)
                assert row.lease_attempt is not None
                await b.store.leases.release(owner, [(t.id, row.lease_attempt)])
                status = await _wait_placed(b, t.id, 3.0)
        assert status is State.SCHEDULING, f"3 s after its lease was given back: {status.label}"


async def test_reconcile_brings_parked_tasks_back_now_and_then(settings: Settings) -> None:
    """The backstop for a park that raced a node's change unseen: every PRUNE_S the reconciler
    moves `sked:parked` back to the line and wakes dispatch, which parks again what still
    fits nowhere."""
    async with backends(settings) as b:
        [t] = await b.store.tasks.create_many([spec("p")], walk=(State.PENDING, State.READY))
        await b.ready_queue.park([t])
        await b.ready_queue.mark_built()
        hub = Hub()
        reconciler = Reconciler(settings, b.store, b.ready_queue, hub)
        assert await reconciler.reconcile_once() == 1
        assert await b.ready_queue.depths() == {"ready": 1, "parked": 0, "resource": 0, "fenced": 0}
        assert hub.dispatch.is_set()


async def test_a_task_waiting_for_a_full_node_does_not_idle_another_nodes_slot(
    settings: Settings,
) -> None:
    """A pass pops as many tasks as the ready nodes have free slots, whichever nodes those are.
    A task at the head that only a full node can take went back in line, at the head, and was
    popped again by every pass for the idle node's slot: a task behind it that the idle node
    takes waited for as long as the full node stayed busy. Now a pass that put tasks back in
    line while room was left looks past them (the next pass pops that many more), and the
    task behind is placed at once."""
    async with backends(settings) as b:
        for node, pool in (("na", "a"), ("nb", "b")):
            await b.bus.declare_node_queue(await b.bus.consumer_channel(1), node)
            await b.store.nodes.register(node, 1, 0.0, 0, 0, {"pool": pool}, uuid4(), prefetch=0)
        [busy] = await b.store.tasks.create_many(
            [spec("busy", selector={"pool": "a"})], walk=(State.PENDING, State.READY)
        )
        await fsm.apply(b.store.tasks, busy, State.SCHEDULING, node="na")  # na is full
        head, behind = await b.store.tasks.create_many(
            [
                spec("head", selector={"pool": "a"}, priority=5),
                spec("behind", selector={"pool": "b"}),
            ],
            walk=(State.PENDING, State.READY),
        )
        await b.ready_queue.push([head, behind])
        await b.ready_queue.mark_built()
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        async with asyncio.timeout(BOUND_S):
            async with scheduler:
                status = await _wait_placed(b, behind.id, 8.0)
            placed = await b.store.tasks.get(behind.id)
            waiting = await b.store.tasks.get(head.id)
        assert status is State.SCHEDULING, (
            f"after 8 s with nb idle the pool=b task is still {status.label}: the pool=a task"
            " at the head took nb's slot count every pass"
        )
        assert placed.node == "nb"
        assert waiting.status is State.READY  # still waiting for na's room, in line
