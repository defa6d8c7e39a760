"""Degrade modes on real Postgres (and alerts in a real Alertmanager): the row's CAS and its
end by Postgres time, the evaluator's triggers under its lock, two schedulers' copies, a manual
mode a trigger does not weaken, and the alerts of a degrade change and of a lost task."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import uuid4

import asyncpg
import pytest
from redis.asyncio import Redis

from services.recovery.service import Recovery
from services.scheduler.degrade import Degrade
from services.scheduler.hub import Hub
from shared import fsm, modes
from shared.alerts import Alerter
from shared.degrade import Mode
from shared.fsm import State
from shared.models import Task
from shared.queues import ReadyQueue
from shared.relay import OutboxRelay
from shared.settings import Settings
from shared.store import Store
from tests import alertmanager
from tests.helpers import spec

FAST = {
    "degrade_waiting": 2,
    "degrade_waiting_for_s": 1.0,
    "degrade_gpu_for_s": 60.0,
    "degrade_healthy_for_s": 60.0,
}


async def ready(store: Store, n: int = 1, **kw: object) -> list[Task]:
    admitted = await store.tasks.admit_many(
        [spec(f"t{i}", **kw) for i in range(n)],
        [uuid4() for _ in range(n)],
        (State.PENDING, State.READY),
    )
    return [task for task, _ in admitted]


@pytest.fixture
async def queue(redis_url: str) -> AsyncIterator[ReadyQueue]:
    redis = Redis.from_url(redis_url)
    yield ReadyQueue(redis, 5.0)
    await redis.aclose()


def evaluator(settings: Settings, store: Store, queue: ReadyQueue) -> Degrade:
    s = settings.model_copy(update=FAST)
    return Degrade(s, store, queue, Hub(), None, Alerter(None, None))


async def test_the_row_changes_by_cas_and_ends_by_postgres_time(store: Store) -> None:
    first = await store.degrade.read()
    assert (first.mode, first.effective(), first.until) == (Mode.NORMAL, Mode.NORMAL, None)
    full = await store.degrade.set(Mode.FULL, "maintenance", "ann", 0.5, first.version)
    assert full is not None
    assert full.until is not None
    assert (full.until - full.since).total_seconds() == pytest.approx(0.5)
    assert await store.degrade.set(Mode.PARTIAL, "late", "bob", None, first.version) is None
    assert (await store.degrade.read()).effective() is Mode.FULL
    await asyncio.sleep(0.6)
    over = await store.degrade.read()
    assert (over.mode, over.effective()) == (Mode.FULL, Mode.NORMAL)  # by Postgres's clock


async def test_placement_reads_the_mode_in_force_with_the_nodes(store: Store) -> None:
    """A placement pass reads the mode in the statement that reads the nodes' usage: the
    row's mode while it lasts, normal once its `until` has passed by Postgres's clock."""

    async def placement_mode() -> Mode | None:
        async with store.transaction() as tx:
            return (await tx.nodes.lock_and_read())[1]

    assert await placement_mode() is None  # no node: nothing to carry it, nothing placed
    await store.nodes.register("n", 1, 1.0, 1024, 0, {}, uuid4())
    assert await placement_mode() is Mode.NORMAL
    first = await store.degrade.read()
    assert await store.degrade.set(Mode.PARTIAL, "busy", "ann", 0.5, first.version) is not None
    assert await placement_mode() is Mode.PARTIAL
    await asyncio.sleep(0.6)
    assert await placement_mode() is Mode.NORMAL


async def test_each_trigger_enters_its_mode_for_its_time_and_leaves_at_until(
    store: Store, pool: asyncpg.Pool, settings: Settings, queue: ReadyQueue
) -> None:
    degrade = evaluator(settings, store, queue)
    # more tasks waiting than the bound -> partial for degrade_waiting_for_s
    waiting = await ready(store, 3)
    await degrade.evaluate()
    busy = await store.degrade.read()
    assert (busy.mode, busy.automatic) == (Mode.PARTIAL, True)
    assert "3 tasks waiting" in busy.reason
    assert busy.until is not None
    assert (busy.until - busy.since).total_seconds() == pytest.approx(1.0)
    for task in waiting:
        await fsm.apply(store.tasks, task, State.CANCELED, reason="test")
    await degrade.evaluate()
    assert (await store.degrade.read()).mode is Mode.PARTIAL  # not before its until
    await asyncio.sleep(1.1)
    await degrade.evaluate()
    left = await store.degrade.read()
    assert (left.mode, left.automatic) == (Mode.NORMAL, True)
    assert "ended at its until" in left.reason
    assert left.since >= busy.until  # left at until, by Postgres's clock

    # GPUs held above 95 % of the healthy nodes' -> partial
    await store.nodes.register("gpu-a", 4, 8.0, 1024, 2, {}, uuid4())
    gpu_tasks = await ready(store, 2, resources={"gpu": 1})
    for task in gpu_tasks:
        placed = await fsm.apply(store.tasks, task, State.SCHEDULING, node="gpu-a")
        await fsm.apply(store.tasks, placed, State.RUNNING, lease_owner=str(uuid4()))
    await degrade.evaluate()
    gpu = await store.degrade.read()
    assert (gpu.mode, gpu.automatic) == (Mode.PARTIAL, True)
    assert "2 of 2 GPUs" in gpu.reason

    # fewer than half of the nodes healthy -> full, stronger than the automatic partial
    for name in ("n1", "n2", "n3"):
        await store.nodes.register(name, 4, 4.0, 1024, 0, {}, uuid4())
    await pool.execute(
        "UPDATE nodes SET heartbeat_at = now() - interval '60 seconds' WHERE id <> 'gpu-a'"
    )
    await degrade.evaluate()
    sick = await store.degrade.read()
    assert (sick.mode, sick.automatic) == (Mode.FULL, True)
    assert "1 of 4 nodes healthy" in sick.reason


async def test_a_backlog_rests_after_its_mode_so_that_it_drains(
    store: Store, settings: Settings, queue: ReadyQueue
) -> None:
    """Partial mode dispatches none of a backlog below its threshold, so the backlog is still
    there when the mode ends: the evaluator leaves it normal for as long as the mode lasted
    (by Postgres's clock), in which the backlog is dispatched, and only then judges again.
    Were it to enter partial again at once, those tasks would wait for ever."""
    degrade = evaluator(settings, store, queue)
    await ready(store, 3)
    await degrade.evaluate()
    busy = await store.degrade.read()
    assert (busy.mode, busy.automatic) == (Mode.PARTIAL, True)
    await asyncio.sleep(1.1)
    await degrade.evaluate()
    left = await store.degrade.read()
    assert (left.mode, left.automatic) == (Mode.NORMAL, True)  # the backlog is still there
    await degrade.evaluate()
    assert (await store.degrade.read()).version == left.version  # resting: nothing written
    await asyncio.sleep(1.1)
    await degrade.evaluate()
    again = await store.degrade.read()
    assert (again.mode, again.automatic) == (Mode.PARTIAL, True)
    assert (again.since - left.since).total_seconds() >= 1.0


async def test_a_manual_mode_is_not_weakened_by_a_trigger(
    store: Store, settings: Settings, queue: ReadyQueue
) -> None:
    degrade = evaluator(settings, store, queue)
    manual = await store.degrade.read()
    await store.degrade.set(Mode.FULL, "upgrade", "ann", None, manual.version)
    await ready(store, 5)  # the waiting trigger (-> partial) holds
    await degrade.evaluate()
    held = await store.degrade.read()
    assert (held.mode, held.automatic, held.set_by) == (Mode.FULL, False, "ann")


async def test_two_schedulers_agree_and_one_evaluates_at_a_time(
    store: Store, settings: Settings, queue: ReadyQueue
) -> None:
    one, two = evaluator(settings, store, queue), evaluator(settings, store, queue)
    await ready(store, 3)
    version = (await store.degrade.read()).version
    await asyncio.gather(one.evaluate(), two.evaluate(), one.evaluate(), two.evaluate())
    after = await store.degrade.read()
    assert after.version == version + 1  # entered once, whoever held the lock
    await asyncio.gather(one.refresh(), two.refresh())
    assert one.hub.degrade.mode() is two.hub.degrade.mode() is Mode.PARTIAL
    # a mode set by hand reaches both copies through NOTIFY sked_degrade
    await store.degrade.set(Mode.FULL, "by hand", "ann", None, after.version)
    await asyncio.gather(one.refresh(), two.refresh())
    assert one.hub.degrade.mode() is two.hub.degrade.mode() is Mode.FULL


async def test_alertmanager_receives_degrade_and_lost_task_alerts(
    store: Store, settings: Settings, tmp_path: Path, queue: ReadyQueue
) -> None:
    async with alertmanager.alertmanager(tmp_path / "am") as url:
        alerter = Alerter(None, url)
        try:
            before, after = await modes.change(
                store.degrade, Mode.PARTIAL, "GPU maintenance", "ann", 600, None, alerter
            )
            # a lost task: recovery moves it on and raises SkedTaskLost
            (task,) = await ready(store, 1, max_retries=1)
            task = await fsm.apply(store.tasks, task, State.SCHEDULING, node="n9")
            task = await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(uuid4()))
            await store.tasks.transition_many(
                [fsm.plan(task, State.LOST, "node n9 gone", lease_owner=str(task.lease_owner))]
            )
            recovery = Recovery(settings, store, queue, OutboxRelay(store, None, 1), alerter)  # type: ignore[arg-type]
            assert [t.id for t in await recovery.recover_lost()] == [task.id]

            deadline = time.monotonic() + 15
            while True:
                degraded = await alertmanager.alerts(url, alertname="SkedDegraded")
                lost = await alertmanager.alerts(url, alertname="SkedTaskLost")
                if (degraded and lost) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            assert len(degraded) == 1
            assert degraded[0]["labels"] == {
                "alertname": "SkedDegraded",
                "severity": "warning",
                "service": "sked",
                "mode": "partial",
            }
            assert degraded[0]["annotations"] == {
                "summary": "scheduler in partial mode (by ann)",
                "description": "GPU maintenance",
            }
            assert degraded[0]["status"]["state"] == "active"
            assert len(lost) == 1
            assert lost[0]["labels"]["task_id"] == str(task.id)
            assert lost[0]["labels"]["node"] == "n9"
            assert "lost on n9" in lost[0]["annotations"]["summary"]

            # leaving the mode resolves its alert: Alertmanager no longer lists it as active
            await modes.change(store.degrade, Mode.NORMAL, "done", "ann", None, None, alerter)
            deadline = time.monotonic() + 15
            while await alertmanager.alerts(url, alertname="SkedDegraded"):
                assert time.monotonic() < deadline, "the degrade alert was not resolved"
                await asyncio.sleep(0.2)
            assert after.until is not None
            assert before.mode is Mode.NORMAL
        finally:
            await alerter.close()


async def test_an_automatic_full_mode_ends_once_its_nodes_have_been_back_a_while(
    store: Store, pool: asyncpg.Pool, settings: Settings, queue: ReadyQueue
) -> None:
    """Three of four nodes missed their heartbeats for a moment (a blip of the network, a
    restart of Postgres): full mode for degrade_healthy_for_s — 30 minutes by default, in which
    nothing at all was dispatched although every node was back within seconds. Now the mode
    ends once its cause has been gone degrade_calm_s, timed in the row by Postgres's clock,
    so two schedulers taking turns at the evaluation count from the same moment."""
    one = Degrade(
        settings.model_copy(update={**FAST, "degrade_calm_s": 0.5}),
        store,
        queue,
        Hub(),
        None,
        Alerter(None, None),
    )
    two = Degrade(one.settings, store, queue, Hub(), None, Alerter(None, None))
    for name in ("n1", "n2", "n3", "n4"):
        await store.nodes.register(name, 4, 4.0, 1024, 0, {}, uuid4())
    stale = "UPDATE nodes SET heartbeat_at = now() - interval '60 seconds' WHERE id <> 'n1'"
    await pool.execute(stale)
    await one.evaluate()
    sick = await store.degrade.read()
    assert (sick.mode, sick.automatic) == (Mode.FULL, True)
    await pool.execute("UPDATE nodes SET heartbeat_at = now()")  # every node back
    await two.evaluate()  # the cause is gone: from now on, by Postgres's clock
    calm = await store.degrade.read()
    assert (calm.mode, calm.version) == (Mode.FULL, sick.version)  # not at once
    assert calm.calm_s is not None
    await pool.execute(stale)  # gone again before the calm was long enough: it starts over
    await one.evaluate()
    assert (await store.degrade.read()).calm_s is None
    await pool.execute("UPDATE nodes SET heartbeat_at = now()")
    await two.evaluate()
    await asyncio.sleep(0.6)
    await pool.execute("UPDATE nodes SET heartbeat_at = now()")
    await one.evaluate()
    lifted = await store.degrade.read()
    assert (lifted.mode, lifted.automatic) == (Mode.NORMAL, True)
    assert "full mode lifted: its cause gone for" in lifted.reason
    assert lifted.until is None
    # a manual full mode is the operator's: never lifted for calm
    await store.degrade.set(Mode.FULL, "upgrade", "ann", None, lifted.version)
    for _ in range(2):
        await one.evaluate()
        await asyncio.sleep(0.6)
    held = await store.degrade.read()
    assert (held.mode, held.automatic, held.set_by, held.calm_s) == (Mode.FULL, False, "ann", None)


async def test_executors_that_stop_cleanly_are_not_nodes_lost(
    store: Store, settings: Settings, queue: ReadyQueue
) -> None:
    """Scaling executors from four down to one, each stopped cleanly, set full mode for 30
    minutes: "1 of 4 nodes healthy". A node left cleanly is not counted by the trigger (nor
    alerted as lost); one that stops heartbeating without leaving still is, and a node served
    again counts again."""
    degrade = evaluator(settings, store, queue)
    boots = {name: uuid4() for name in ("n1", "n2", "n3", "n4")}
    for name, boot in boots.items():
        await store.nodes.register(name, 4, 4.0, 1024, 0, {}, boot)
    for name in ("n2", "n3", "n4"):
        await store.nodes.leave(name, boots[name])
    await degrade.evaluate()
    snapshot = await store.degrade.snapshot(settings.node_ttl_s, settings.degrade_nodes_seen_s)
    assert (snapshot.nodes_total, snapshot.nodes_healthy, list(snapshot.unhealthy)) == (1, 1, [])
    assert (await store.degrade.read()).mode is Mode.NORMAL
    assert degrade.nodes_down == set()
    # served again, then marked not ready without leaving (a monitor found no executor): lost
    for name in ("n2", "n3"):
        await store.nodes.register(name, 4, 4.0, 1024, 0, {}, boots[name])
        await store.nodes.set_ready(name, boots[name], False)
    await degrade.evaluate()
    assert (await store.degrade.read()).mode is Mode.FULL  # 1 of 3 healthy
    assert degrade.nodes_down == {"n2", "n3"}
