"""Admission and placement in one statement (sked_admit), on real Postgres: the placement a
scheduler planned on nodes read without locks is applied only where, under the nodes' locks,
the node is still live, of the same incarnation, uncordoned, and has room for every task
planned there; otherwise the tasks stay Ready. Nothing is overcommitted, nothing existing is
moved, and each move is an ordinary recorded transition."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from uuid import UUID, uuid4

import asyncpg
import pytest

from shared import fsm
from shared.degrade import Mode
from shared.fsm import State
from shared.models import Task, TaskSpec
from shared.store import Placing, Store
from shared.store.db import Db
from shared.store.store import Tx
from tests.helpers import eventually, spec

ADMISSION = (State.PENDING, State.READY)
TTL_S = 10.0


def planned(ids: Sequence[UUID], specs: Sequence[TaskSpec], nodes: Sequence[str]) -> list[fsm.Move]:
    """The moves a scheduler plans for tasks about to be admitted: Ready (version 3) ->
    Scheduling on the node given for each."""
    return [
        fsm.plan(
            fsm.Newborn(i, State.READY, 3, s.max_retries, s.max_launch_failures),
            State.SCHEDULING,
            "placed",
            node=n,
        )
        for i, s, n in zip(ids, specs, nodes, strict=True)
    ]


async def boot_ids(store: Store) -> dict[str, UUID]:
    return {n.id: n.boot_id for n in await store.nodes.all()}


async def admit(
    store: Store, specs: Sequence[TaskSpec], nodes: Sequence[str], boots: dict[str, UUID]
) -> list[Task]:
    ids = [uuid4() for _ in specs]
    placing = Placing(planned(ids, specs, nodes), boots, TTL_S)
    admitted = await store.tasks.admit_many(specs, ids, ADMISSION, None, placing)
    return [t for t, _ in admitted]


async def test_a_planned_placement_with_room_is_applied_and_recorded(store: Store) -> None:
    await store.nodes.register("n1", 4, 2.0, 1024, 0, {}, uuid4())
    await store.nodes.register("n2", 4, 2.0, 1024, 0, {}, uuid4())
    boots = await boot_ids(store)
    tasks = await admit(store, [spec("a"), spec("b"), spec("c")], ["n1", "n2", "n1"], boots)
    assert [(t.status, t.node, t.attempt, t.version) for t in tasks] == [
        (State.SCHEDULING, "n1", 1, 4),
        (State.SCHEDULING, "n2", 1, 4),
        (State.SCHEDULING, "n1", 1, 4),
    ]
    history = await store.tasks.history(tasks[0].id)
    assert [(e.from_status, e.to_status, e.version) for e in history] == [
        (None, State.CREATED, 1),
        (State.CREATED, State.PENDING, 2),
        (State.PENDING, State.READY, 3),
        (State.READY, State.SCHEDULING, 4),
    ]
    usage = {n.id: n.used_slots for n in await store.nodes.all()}
    assert usage == {"n1": 2, "n2": 1}


async def test_a_node_without_room_for_all_it_was_planned_takes_none(store: Store) -> None:
    """All or nothing per node: planned three tasks with two slots free, the node takes none
    of them (its own check cannot say which the scheduler would rather have kept), while
    another node's plan goes ahead."""
    await store.nodes.register("small", 3, 0.0, 0, 0, {}, uuid4())
    await store.nodes.register("big", 8, 0.0, 0, 0, {}, uuid4())
    boots = await boot_ids(store)
    [held] = await admit(store, [spec("held")], ["small"], boots)
    assert held.status is State.SCHEDULING
    specs = [spec(f"t{i}") for i in range(4)]
    tasks = await admit(store, specs, ["small", "small", "small", "big"], boots)
    assert [(t.status, t.node) for t in tasks] == [
        (State.READY, None),
        (State.READY, None),
        (State.READY, None),
        (State.SCHEDULING, "big"),
    ]
    assert {n.id: n.used_slots for n in await store.nodes.all()} == {"small": 1, "big": 1}


@pytest.mark.parametrize(
    ("need", "node"),
    [
        ({"cpu": 1.5}, {"cpu": 2.0}),
        ({"memory_mb": 600}, {"memory_mb": 1024}),
        ({"gpu": 1}, {"gpu": 1}),
    ],
)
async def test_a_node_short_of_a_resource_takes_nothing_more(
    store: Store, need: dict[str, float], node: dict[str, float]
) -> None:
    """Two tasks planned on a node that has room for one of them by cpu, memory or gpu: the
    second admission finds the first's reservation and places nothing."""
    sized = {"cpu": 0.0, "memory_mb": 0, "gpu": 0, **node}
    await store.nodes.register(
        "n", 8, sized["cpu"], int(sized["memory_mb"]), int(sized["gpu"]), {}, uuid4()
    )
    boots = await boot_ids(store)
    [first] = await admit(store, [spec("a", resources=need)], ["n"], boots)
    [second] = await admit(store, [spec("b", resources=need)], ["n"], boots)
    assert (first.status, second.status) == (State.SCHEDULING, State.READY)


async def test_a_node_registered_anew_since_the_read_takes_nothing(store: Store) -> None:
    """A node whose executor registered again (a new boot id: its labels, size may differ)
    since the scheduler read it is not placed on by that plan."""
    await store.nodes.register("n", 4, 0.0, 0, 0, {"zone": "a"}, uuid4())
    stale = await boot_ids(store)
    await store.nodes.register("n", 4, 0.0, 0, 0, {"zone": "b"}, uuid4())
    [task] = await admit(store, [spec("t", selector={"zone": "a"})], ["n"], stale)
    assert (task.status, task.node, task.version) == (State.READY, None, 3)


async def test_a_node_cordoned_not_ready_or_silent_takes_nothing(
    store: Store, pool: asyncpg.Pool
) -> None:
    for name in ("cordoned", "draining", "silent", "fine"):
        await store.nodes.register(name, 4, 0.0, 0, 0, {}, uuid4())
    boots = await boot_ids(store)
    assert await store.nodes.cordon("cordoned", "alice", "disk")
    await store.nodes.set_ready("draining", boots["draining"], False)
    await pool.execute(
        "UPDATE nodes SET heartbeat_at = now() - interval '1 hour' WHERE id = 'silent'"
    )
    names = ["cordoned", "draining", "silent", "fine"]
    tasks = await admit(store, [spec(n) for n in names], names, boots)
    assert {t.name: t.status for t in tasks} == {
        "cordoned": State.READY,
        "draining": State.READY,
        "silent": State.READY,
        "fine": State.SCHEDULING,
    }


@pytest.mark.parametrize("mode", [Mode.PARTIAL, Mode.FULL])
async def test_a_degrade_mode_in_force_places_nothing_one_that_ended_does(
    store: Store, pool: asyncpg.Pool, mode: Mode
) -> None:
    await store.nodes.register("n", 4, 0.0, 0, 0, {}, uuid4())
    boots = await boot_ids(store)
    state = await store.degrade.read()
    assert await store.degrade.set(mode, "test", "alice", 3600, state.version) is not None
    [held] = await admit(store, [spec("held")], ["n"], boots)
    assert held.status is State.READY
    await pool.execute("UPDATE degrade SET until = now() - interval '1 second'")
    [placed] = await admit(store, [spec("placed")], ["n"], boots)
    assert placed.status is State.SCHEDULING


async def test_a_task_that_existed_is_never_moved_by_a_planned_placement(store: Store) -> None:
    """A submission delivered again names a task that exists (Ready, in line): the plan made
    for it is not applied; the task comes back as it was."""
    await store.nodes.register("n", 4, 0.0, 0, 0, {}, uuid4())
    boots = await boot_ids(store)
    task_id, s = uuid4(), spec("again")
    [(before, new)] = await store.tasks.admit_many([s], [task_id], ADMISSION)
    assert new
    placing = Placing(planned([task_id], [s], ["n"]), boots, TTL_S)
    [(after, new)] = await store.tasks.admit_many([s], [task_id], ADMISSION, None, placing)
    assert not new
    assert (after.status, after.version, after.node) == (State.READY, before.version, None)
    assert (await store.tasks.get(task_id)).status is State.READY
    assert {n.id: n.used_slots for n in await store.nodes.all()} == {"n": 0}


async def test_an_admission_that_waited_for_the_node_locks_sees_the_reservation_made_meanwhile(
    store: Store, pool: asyncpg.Pool
) -> None:
    """The race the check is for: scheduler A's dispatch pass holds the node locks and
    reserves the node's only slot; scheduler B's admission, planned on the node as it was
    before, waits for the lock. Once A commits, B must see A's reservation and place
    nothing (else two attempts would hold one slot)."""
    await store.nodes.register("n", 1, 0.0, 0, 0, {}, uuid4())
    boots = await boot_ids(store)
    [(queued, _)] = await store.tasks.admit_many([spec("queued")], [uuid4()], ADMISSION)
    async with pool.acquire() as a:
        tx = a.transaction()
        await tx.start()
        try:
            tx_a = Tx(Db(a, 0.5), TTL_S)
            [seen], _ = await tx_a.nodes.lock_and_read()
            assert seen.used_slots == 0
            await tx_a.tasks.transition_many([fsm.plan(queued, State.SCHEDULING, node="n")])
            b = asyncio.ensure_future(admit(store, [spec("late")], ["n"], boots))

            async def b_waits_for_the_lock() -> bool:
                return bool(
                    await pool.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE '%sked_admit%'"
                    )
                )

            await eventually(b_waits_for_the_lock, timeout=10, what="B to wait for the lock")
        finally:
            await tx.commit()
        [late] = await asyncio.wait_for(b, timeout=10)
    assert (late.status, late.node) == (State.READY, None)
    assert {n.id: n.used_slots for n in await store.nodes.all()} == {"n": 1}


async def test_a_node_planned_more_than_a_notification_lists_still_takes_them_all(
    store: Store,
) -> None:
    """The node is told of at most 100 new attempts by notification; past that it learns of
    them by their dispatch message alone — the moves themselves are all applied."""
    await store.nodes.register("n", 200, 0.0, 0, 0, {}, uuid4())
    boots = await boot_ids(store)
    specs = [spec(f"t{i}") for i in range(101)]
    tasks = await admit(store, specs, ["n"] * len(specs), boots)
    assert {t.status for t in tasks} == {State.SCHEDULING}
    assert {n.id: n.used_slots for n in await store.nodes.all()} == {"n": 101}
