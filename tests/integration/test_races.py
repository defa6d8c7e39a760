"""Races, replicas and odd orders of events against the scheduler's parts and the executor's
start, on real Postgres, Redis and RabbitMQ. Each case was found by an adversarial review: it
left a task waiting for good, started an attempt twice, or undid an operator's change; the
docstrings say what it did, and each test now shows it does not."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from uuid import UUID, uuid4

import asyncpg
import pytest
from redis.asyncio import Redis

from services.scheduler.hub import Hub
from services.scheduler.resolve import Resolver
from shared import control, fsm, workflows
from shared.dag import WorkflowSpec
from shared.fsm import State
from shared.queues import ReadyQueue
from shared.settings import Settings
from shared.store import Store
from shared.store.notify import TASK_CHANNEL


@pytest.fixture
async def queue(redis_url: str) -> AsyncIterator[ReadyQueue]:
    redis = Redis.from_url(redis_url)
    try:
        yield ReadyQueue(redis, 30.0)
    finally:
        await redis.aclose()


async def _run_to_success(store: Store, task_id: UUID) -> None:
    t = await store.tasks.get(task_id)
    t = await fsm.apply(store.tasks, t, State.SCHEDULING, node="n1")
    t = await fsm.apply(store.tasks, t, State.RUNNING, lease_owner=str(uuid4()))
    await fsm.apply(store.tasks, t, State.SUCCESS)


async def test_dependency_timeout_never_fires_while_other_workflows_keep_finishing(
    settings: Settings, store: Store, dsn: str, queue: ReadyQueue
) -> None:
    """The workflow loop finds dependency timeouts only in its periodic sweep, and it sweeps
    only when a whole SKED_RECONCILE_S passes with no workflow NOTIFY. Any other workflow
    finishing a task more often than that (a busy cluster) starves the sweep: a Pending task
    whose upstream is paused waits forever although its edge says go on without it after
    0.3 s."""
    s = settings.model_copy(update={"reconcile_s": 1.0})
    hub = Hub()
    resolver = Resolver(s, store, queue, hub)
    listen = await asyncpg.connect(dsn)
    await listen.add_listener(TASK_CHANNEL, hub.task_notify)

    # the workflow that waits: `late` needs `up` (paused), skip after 0.3 s
    waiting_wf = uuid4()
    await workflows.admit(
        store,
        waiting_wf,
        WorkflowSpec.parse(
            {
                "name": "waits",
                "tasks": [
                    {"name": "up", "command": ["true"]},
                    {
                        "name": "late",
                        "command": ["true"],
                        "needs": [{"task": "up", "timeout_s": 0.3, "on_timeout": "skip"}],
                    },
                ],
            }
        ),
    )
    up = workflows.task_id(waiting_wf, "up")
    late = workflows.task_id(waiting_wf, "late")
    await control.pause(store, up, "hold", by="ops")

    # a busy neighbour: a workflow of many independent tasks, one finishing every 0.25 s
    busy_wf = uuid4()
    n = 24
    await workflows.admit(
        store,
        busy_wf,
        WorkflowSpec.parse(
            {"name": "busy", "tasks": [{"name": f"b{i}", "command": ["true"]} for i in range(n)]}
        ),
    )
    stopping = asyncio.Event()
    loop = asyncio.create_task(resolver.run(stopping))
    try:
        for i in range(n):
            await asyncio.sleep(0.25)
            await _run_to_success(store, workflows.task_id(busy_wf, f"b{i}"))
        # 6 s: twenty times the edge's timeout, six reconcile periods
        state = (await store.tasks.get(late)).status
    finally:
        stopping.set()
        hub.resolve.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(loop, 5)
        await listen.close()
    # `skip` goes on without the upstream: released to Ready
    assert state is State.READY, (
        f"`late` is still {state.label} 6 s after its 0.3 s dependency timeout ran out"
    )


async def test_priority_change_during_a_dispatch_pass_is_undone_by_its_requeue(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator raises a Ready task's priority while a dispatch pass holds it (popped, read,
    not placeable yet: its node's CPU is busy). `set_priority` re-scores it in the queue, then
    the pass puts it back in line with the score of the row it read before the change: the
    new priority is lost from the queue for good (nothing re-scores an entry that exists), and
    lower-priority tasks keep going first."""
    from services.scheduler.service import Scheduler
    from shared.store.tasks import Tasks
    from shared.wiring import backends
    from tests.helpers import spec

    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await b.bus.declare_node_queue(await b.bus.consumer_channel(1), "n1")
        await b.store.nodes.register("n1", 4, 2.0, 0, 0, {}, uuid4(), prefetch=0)
        # a running attempt holds 1.5 of the node's 2 CPUs
        (busy,) = await b.store.tasks.create_many(
            [spec("busy", resources={"cpu": 1.5})], walk=(State.PENDING, State.READY)
        )
        busy = await fsm.apply(b.store.tasks, busy, State.SCHEDULING, node="n1")
        await fsm.apply(b.store.tasks, busy, State.RUNNING, lease_owner=str(uuid4()))
        (t,) = await b.store.tasks.create_many(
            [spec("t", resources={"cpu": 1.0})], walk=(State.PENDING, State.READY)
        )
        await b.ready_queue.push([t])

        real = Tasks.get_ready
        raised = []

        async def get_ready_then_operator(self: Tasks, ids: list[UUID]) -> object:
            got = await real(self, ids)
            if t.id in ids and not raised:  # the operator acts while the pass holds `t`
                raised.append(await control.set_priority(b.store, b.ready_queue, t.id, 9))
            return got

        monkeypatch.setattr(Tasks, "get_ready", get_ready_then_operator)
        assert await scheduler.dispatch.dispatch_once() == 0  # no CPU for `t` yet
        assert raised
        now = await b.store.tasks.get(t.id)
        assert now.priority == 9
        assert now.status is State.READY
        queued = await b.ready_queue.redis.zscore("sked:ready", str(t.id))
        assert queued == pytest.approx(b.ready_queue.score_of(now), abs=1e-3), (
            f"queued at the score of priority {t.priority} ({queued}), "
            f"not of priority 9 ({b.ready_queue.score_of(now)})"
        )


async def test_task_parked_while_its_node_was_marked_not_ready_is_never_placed_again(
    settings: Settings,
) -> None:
    """The heartbeat-monitor marks a node not ready when no executor of it answers a probe
    (the executor was reconnecting); a task submitted meanwhile finds no ready node and is
    parked in `sked:parked`. The executor's next node heartbeat sets the row ready again, but
    that UPDATE sends no NOTIFY, so nothing unparks the task: neither the scheduler's
    reconcile (it only unparks resource waiters) nor recovery's (a parked task counts as
    queued). With the node idle and ready, the task stays Ready for good."""
    from services.scheduler.service import Scheduler
    from shared.queues import reconcile
    from shared.wiring import backends
    from tests.helpers import spec

    s = settings.model_copy(update={"reconcile_s": 0.5})
    async with backends(s) as b:
        boot = uuid4()
        await b.bus.declare_node_queue(await b.bus.consumer_channel(4), "n1")
        await b.store.nodes.register("n1", 4, 0.0, 0, 0, {"zone": "a"}, boot, prefetch=0)
        # another node, up all along, that the task's selector rules out
        await b.bus.declare_node_queue(await b.bus.consumer_channel(4), "n2")
        await b.store.nodes.register("n2", 4, 0.0, 0, 0, {"zone": "b"}, uuid4(), prefetch=0)
        scheduler = Scheduler(s, b.store, b.bus, b.ready_queue)
        async with scheduler:
            # the monitor's ladder: a probe came straight back (executor reconnecting)
            await b.store.nodes.set_ready("n1", boot, False)
            await asyncio.sleep(0.3)
            (t,) = await b.store.tasks.create_many(
                [spec("t", selector={"zone": "a"})], walk=(State.PENDING, State.READY)
            )
            await b.ready_queue.push([t])
            scheduler.hub.work_arrived()
            for _ in range(50):
                await asyncio.sleep(0.05)
                if (await b.ready_queue.depths())["parked"]:
                    break
            assert (await b.ready_queue.depths())["parked"] == 1  # "no ready node"
            # the executor is back: its node heartbeat re-asserts the row ready
            assert await b.store.nodes.heartbeat("n1", boot, 0.0)
            assert all(n.ready for n in await b.store.nodes.all())
            for _ in range(8):  # 4 s: eight reconcile periods, recovery's pass each time
                await asyncio.sleep(0.5)
                await b.store.nodes.heartbeat("n1", boot, 0.0)
                await reconcile(b.ready_queue, b.store.tasks, s.reconcile_s)
            now = await b.store.tasks.get(t.id)
        assert now.status is State.SCHEDULING, (
            f"an idle ready node, yet the task is {now.status.label}: {now.status_reason}"
        )


async def test_partial_mode_starves_urgent_tasks_behind_ones_that_cannot_be_placed(
    settings: Settings,
) -> None:
    """Partial mode (e.g. the GPU trigger: GPUs held above 95 %) picks its candidates in
    Postgres, by priority, SKED_DEGRADE_PARTIAL_BATCH a pass. Urgent GPU tasks waiting for a
    GPU are Ready in Postgres, so every pass picks the same ones again, places none, and never
    reaches the urgent CPU-only task behind them, though the node has free slots and CPU: it
    waits as long as partial lasts (the GPU trigger never rests while GPUs stay busy)."""
    from services.scheduler.service import Scheduler
    from shared.degrade import Mode
    from shared.wiring import backends
    from tests.helpers import spec

    s = settings.model_copy(update={"degrade_partial_batch": 3})
    async with backends(s) as b:
        scheduler = Scheduler(s, b.store, b.bus, b.ready_queue)
        await b.bus.declare_node_queue(await b.bus.consumer_channel(4), "n1")
        await b.store.nodes.register("n1", 8, 8.0, 0, 1, {}, uuid4(), prefetch=0)
        # the node's one GPU is held by a running attempt
        (holder,) = await b.store.tasks.create_many(
            [spec("holder", resources={"gpu": 1})], walk=(State.PENDING, State.READY)
        )
        holder = await fsm.apply(b.store.tasks, holder, State.SCHEDULING, node="n1")
        await fsm.apply(b.store.tasks, holder, State.RUNNING, lease_owner=str(uuid4()))
        gpu_tasks = await b.store.tasks.create_many(
            [spec(f"g{i}", priority=300, resources={"gpu": 1}) for i in range(3)],
            walk=(State.PENDING, State.READY),
        )
        (cpu,) = await b.store.tasks.create_many(
            [spec("cpu", priority=200, resources={"cpu": 1.0})], walk=(State.PENDING, State.READY)
        )
        await b.ready_queue.push([*gpu_tasks, cpu])
        state = await b.store.degrade.read()
        assert await b.store.degrade.set(Mode.PARTIAL, "gpus busy", "ann", 3600, state.version)
        for _ in range(20):
            await scheduler.dispatch.dispatch_once()
        now = await b.store.tasks.get(cpu.id)
        assert now.status is State.SCHEDULING, (
            f"urgent task (priority 200) on a node with 7 free slots is {now.status.label}: "
            f"{now.status_reason}"
        )


async def test_dependency_timeout_never_fires_beyond_the_sweeps_first_10000_pending_tasks(
    settings: Settings, store: Store, queue: ReadyQueue
) -> None:
    """The workflow loop's sweep reads `pending_with_deps(10_000)`: the same first 10,000
    Pending tasks (by id) every time. When those all wait on a paused upstream, a Pending
    task past them is never looked at, so its dependency timeout never fires: here a fan-out
    of 10,001 tasks from one paused root, the one with the highest id allowed to go on
    without it after 0.3 s, still Pending after 8 sweeps."""
    s = settings.model_copy(update={"reconcile_s": 0.5})
    wf = uuid4()
    names = [f"d{i:05d}" for i in range(10_001)]
    last = max(names, key=lambda name: workflows.task_id(wf, name))
    tasks: list[dict[str, object]] = [{"name": "up", "command": ["true"]}]
    for name in names:
        edge: dict[str, object] = {"task": "up"}
        if name == last:
            edge.update(timeout_s=0.3, on_timeout="skip")
        tasks.append({"name": name, "command": ["true"], "needs": [edge]})
    await workflows.admit(store, wf, WorkflowSpec.parse({"name": "fan", "tasks": tasks}))
    await control.pause(store, workflows.task_id(wf, "up"), "hold", by="ops")
    hub = Hub()
    stopping = asyncio.Event()
    loop = asyncio.create_task(Resolver(s, store, queue, hub).run(stopping))
    try:
        await asyncio.sleep(4.0)
        state = (await store.tasks.get(workflows.task_id(wf, last))).status
    finally:
        stopping.set()
        hub.resolve.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(loop, 10)
    assert state is State.READY, f"still {state.label} 4 s after its 0.3 s dependency timeout"


async def test_an_attempt_delivered_twice_is_started_twice_when_the_second_claim_is_retried(
    executor: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One attempt reaches its executor twice at once (the placement's NOTIFY and the
    follow-up dispatch message sent because it was still Scheduling a moment before; or a
    redelivery after a reconnect). Both copies pass `_checked` (neither is in node.active
    yet). The first claim wins; the second's first try fails on a dropped connection and its
    retry loses to the first. `settle` then sees tries > 1 and a task Running in this attempt
    under this executor's lease, takes it for a lost reply of its own, and begins the attempt
    again: the backend runs attempt 1 twice, at once."""
    from typing import Any

    from services.executor.service import Executor
    from shared.models import Dispatch, Task
    from tests.fakes import StubMessage
    from tests.helpers import spec

    assert isinstance(executor, Executor)
    store = executor.store
    task = await store.tasks.create(spec("once"))
    for target in (State.PENDING, State.READY):
        task = await fsm.apply(store.tasks, task, target)
    task = await fsm.apply(store.tasks, task, State.SCHEDULING, node="n1")

    real = store.tasks.transition_many
    calls = 0

    async def second_call_drops(moves: Any) -> list[Task]:
        nonlocal calls
        calls += 1
        if calls == 2:  # the second copy's first try: the connection dropped before it ran
            await asyncio.sleep(0.05)
            raise ConnectionResetError("connection reset by peer")
        return await real(moves)

    monkeypatch.setattr(store.tasks, "transition_many", second_call_drops)
    runs: list[tuple[UUID, int]] = []
    backend_run = executor.node.backend.run

    async def counting_run(launch: Any) -> Any:
        runs.append((launch.task_id, launch.attempt))
        return await backend_run(launch)

    monkeypatch.setattr(executor.node.backend, "run", counting_run)

    def copy() -> StubMessage:
        return StubMessage(Dispatch.of(task, "n1").model_dump_json().encode(), "n1")

    started = await asyncio.gather(
        executor.starter.start([copy()]),  # type: ignore[list-item]
        executor.starter.start([copy()]),  # type: ignore[list-item]
    )
    await asyncio.sleep(0.5)
    if executor.node.runs:
        await asyncio.wait(executor.node.runs, timeout=30)
    assert runs == [(task.id, 1)], f"attempt 1 started {len(runs)} times ({started})"


async def test_an_attempt_paused_or_canceled_unheard_holds_its_slot_and_resource(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """A task paused (or canceled) while its executor cannot hear it runs on until its lease
    ends. Its node's slot and its workflow's named resource were counted free at once, so the
    next pass placed a second holder beside it: a resource of capacity 1 held twice, a node
    of one slot running two attempts. Now such an attempt holds both until its lease ends or
    its executor releases it; then the task waiting is placed."""
    from services.scheduler.service import Scheduler
    from shared.wiring import backends
    from tests.helpers import spec

    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        for node in ("n1", "n2"):
            await b.bus.declare_node_queue(await b.bus.consumer_channel(2), node)
        await b.store.nodes.register("n1", 4, 4.0, 0, 0, {"zone": "a"}, uuid4(), prefetch=0)
        await b.store.nodes.register("n2", 1, 4.0, 0, 0, {"zone": "b"}, uuid4(), prefetch=0)
        wf = uuid4()
        flow = {
            "name": "licensed",
            "resources": {"licence": 1},
            "tasks": [
                {"name": "a", "command": ["true"], "uses": ["licence"], "selector": {"zone": "a"}},
                {"name": "b", "command": ["true"], "uses": ["licence"], "selector": {"zone": "a"}},
            ],
        }
        await workflows.admit(b.store, wf, WorkflowSpec.parse(flow))
        a, later = (workflows.task_id(wf, n) for n in ("a", "b"))
        (alone,) = await b.store.tasks.create_many(
            [spec("alone", selector={"zone": "b"})], walk=(State.PENDING, State.READY)
        )
        (beside,) = await b.store.tasks.create_many(
            [spec("beside", selector={"zone": "b"})], walk=(State.PENDING, State.READY)
        )
        for task_id, node in ((a, "n1"), (alone.id, "n2")):  # running, leases live (30 s)
            t = await fsm.apply(
                b.store.tasks, await b.store.tasks.get(task_id), State.SCHEDULING, node=node
            )
            await fsm.apply(b.store.tasks, t, State.RUNNING, lease_owner=str(uuid4()))
        await b.ready_queue.push(await b.store.tasks.get_many([later, beside.id]))
        await control.pause(b.store, a, "maintenance", by="ops")  # its executor does not hear
        await control.cancel(b.store, b.ready_queue, alone.id, "no longer wanted", by="ops")

        await scheduler.dispatch.dispatch_once()
        for waiting in (later, beside.id):
            assert (await b.store.tasks.get(waiting)).status is State.READY  # held, not placed

        # the leases end (or their executors release them): the slot and the licence are free
        await pool.execute(
            "UPDATE tasks SET lease_until = now() - interval '1 s' WHERE id = ANY($1::uuid[])",
            [a, alone.id],
        )
        await b.ready_queue.push(await b.store.tasks.get_many([later, beside.id]))
        await scheduler.dispatch.dispatch_once()
        for waiting in (later, beside.id):
            assert (await b.store.tasks.get(waiting)).status is State.SCHEDULING
