"""Workflows at run time and named resources under adversarial orders of events and sizes, on
real Postgres, Redis and RabbitMQ. Each case was found by an adversarial review: its docstring
says what the code did then (a unit held twice or by nobody, a pass over Postgres's message
limit, an `always` task released by a cancel, gigabytes read to decide or cancel nothing),
and the test shows it no longer does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID, uuid4

import asyncpg
import pytest
from redis.asyncio import Redis

from shared import fsm, workflows
from shared.dag import WorkflowSpec
from shared.fsm import State
from shared.queues import ReadyQueue
from shared.settings import Settings
from shared.store import Store


@pytest.fixture
async def queue(redis_url: str) -> AsyncIterator[ReadyQueue]:
    redis = Redis.from_url(redis_url)
    try:
        yield ReadyQueue(redis, 30.0)
    finally:
        await redis.aclose()


async def _run_to(store: Store, task_id: UUID, end: State, **changes: Any) -> None:
    t = await store.tasks.get(task_id)
    t = await fsm.apply(store.tasks, t, State.SCHEDULING, node="n1")
    t = await fsm.apply(store.tasks, t, State.RUNNING, lease_owner=str(uuid4()))
    await fsm.apply(store.tasks, t, end, **changes)


async def test_a_task_no_node_takes_holds_no_resource_unit(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """within_resources (shared/placement.py) handed a unit of the named resource to every task
    it let through *before* place_many decided whether a node takes it. A task let through
    but not placed (its only node is full) keeps that phantom unit for the rest of the pass,
    so the next task of the workflow — placeable on an idle node, with the resource wholly
    free — is set aside 'waiting for resource licence (1/1 held)' while nothing holds it."""
    from services.scheduler.service import Scheduler
    from shared.wiring import backends
    from tests.helpers import spec

    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        for node in ("n1", "n2"):
            await b.bus.declare_node_queue(await b.bus.consumer_channel(2), node)
        await b.store.nodes.register("n1", 1, 4.0, 0, 0, {"zone": "a"}, uuid4(), prefetch=0)
        await b.store.nodes.register("n2", 2, 4.0, 0, 0, {"zone": "b"}, uuid4(), prefetch=0)
        # n1's one slot is taken by an unrelated task
        (filler,) = await b.store.tasks.create_many(
            [spec("filler", selector={"zone": "a"})], walk=(State.PENDING, State.READY)
        )
        t = await fsm.apply(b.store.tasks, filler, State.SCHEDULING, node="n1")
        await fsm.apply(b.store.tasks, t, State.RUNNING, lease_owner=str(uuid4()))

        wf = uuid4()
        flow = {
            "name": "licensed",
            "resources": {"licence": 1},
            "tasks": [
                {
                    "name": "first",
                    "command": ["true"],
                    "uses": ["licence"],
                    "selector": {"zone": "a"},
                    "priority": 9,
                },
                {
                    "name": "second",
                    "command": ["true"],
                    "uses": ["licence"],
                    "selector": {"zone": "b"},
                    "priority": 1,
                },
            ],
        }
        ready = await workflows.admit(b.store, wf, WorkflowSpec.parse(flow))
        await b.ready_queue.push(ready)
        await scheduler.dispatch.dispatch_once()
        second = await b.store.tasks.get(workflows.task_id(wf, "second"))
        first = await b.store.tasks.get(workflows.task_id(wf, "first"))
        held = await b.store.workflows.resources_held([wf])
        assert first.status is State.READY  # its only node is full: it holds nothing
        assert second.status is State.SCHEDULING, (
            f"`second` fits idle node n2 and the licence is free, yet it is "
            f"{second.status.label}: {second.status_reason!r}"
        )
        assert held[(wf, "licence")] == (1, 1)  # held by `second` alone


BLOB = 1_040_000  # characters of an upstream's output: under MAX_RESULT_BYTES (1 MiB)


async def test_a_wide_fan_out_is_released_in_statements_of_bounded_bytes(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each output is capped at 1 MiB and each task's inputs at 8 MiB (dag.MAX_INPUTS_BYTES),
    but nothing bounded what one resolve pass carried: every task released in a pass had its
    inputs in the patch of ONE transition_many statement. 8 upstreams of ~1 MiB each feeding
    135 downstream tasks (legal: each gets ~8.3 MB of inputs) made a ~1.1 GB statement, over
    Postgres's 1 GB message limit: the pass failed as a whole, and so did every pass after it,
    a second workflow's task in the same pass (the sweep decides every workflow's Pending
    tasks together) never released either. The release now goes out in statements of at most
    workflows.RELEASE_BYTES of outputs; shown here at a scale this machine runs in seconds,
    with the bound lowered to match (8 upstreams of 64 KB, 40 downstreams, 1 MB a statement)."""
    import json

    from shared.store.tasks import Tasks

    blob, bound = 64_000, 1_000_000
    monkeypatch.setattr(workflows, "RELEASE_BYTES", bound)
    sent: list[int] = []
    transition_many = Tasks.transition_many

    async def measured(self: Tasks, moves: Any) -> Any:
        sent.append(sum(len(json.dumps(m.patch.get("inputs") or {})) for m in moves))
        return await transition_many(self, moves)

    monkeypatch.setattr(Tasks, "transition_many", measured)
    ups = [f"u{i}" for i in range(8)]
    wide = uuid4()
    flow = {
        "name": "wide",
        "tasks": [{"name": u, "handler": "m:f"} for u in ups]
        + [{"name": f"d{j}", "handler": "m:f", "needs": ups} for j in range(40)],
    }
    await workflows.admit(store, wide, WorkflowSpec.parse(flow))
    other = uuid4()
    await workflows.admit(
        store,
        other,
        WorkflowSpec.parse(
            {
                "name": "other",
                "tasks": [
                    {"name": "a", "command": ["true"]},
                    {"name": "b", "command": ["true"], "needs": ["a"]},
                ],
            }
        ),
    )
    output = {"blob": "x" * blob}
    for u in ups:
        await _run_to(store, workflows.task_id(wide, u), State.SUCCESS, result=output)
    await _run_to(store, workflows.task_id(other, "a"), State.SUCCESS)
    page = await store.workflows.pending_with_deps(10_000)
    assert len(page) == 41
    sent.clear()
    ready, _ = await asyncio.wait_for(workflows.resolve(store, page), 60)
    assert len(ready) == 41
    b = await store.tasks.get(workflows.task_id(other, "b"))
    d0 = await store.tasks.get(workflows.task_id(wide, "d0"))
    assert b.status is State.READY
    assert d0.status is State.READY
    assert d0.inputs == dict.fromkeys(ups, output)
    # 40 x 8 x 64 KB = ~20 MB of inputs, in statements of at most ~1 MB each (one task's
    # inputs may take a statement past the bound alone: ~0.5 MB here)
    assert sum(sent) > 20 * bound
    assert max(sent) <= bound + 8 * (blob + 100), sent


async def test_two_passes_whose_live_nodes_differ_never_hand_out_one_unit_twice(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """Named resources are serialised only by the NODE locks of the placement pass: 'the units
    are counted under the placement locks, so two passes never hand out the same one'. But
    each pass locks only the nodes live at its start. Scheduler S1 starts its pass while n1 is
    live and n2 not yet heard from; n1 falls silent past SKED_NODE_TTL_S and n2 registers
    (autoscaling, a frozen executor) before S2 starts its pass. The two passes lock disjoint
    node sets, neither waits for the other, both count the licence (capacity 1) free, and
    both place a holder: the resource is held twice."""
    from services.scheduler.service import Scheduler
    from shared.wiring import backends

    ttl = 1.5
    s = settings.model_copy(update={"node_ttl_s": ttl})
    async with backends(s) as b:
        s1 = Scheduler(s, b.store, b.bus, b.ready_queue)
        s2 = Scheduler(s, b.store, b.bus, b.ready_queue)
        assert b.store.node_ttl_s == ttl
        await b.store.nodes.register("n1", 2, 4.0, 0, 0, {"zone": "a"}, uuid4(), prefetch=0)
        wf = uuid4()
        flow = {
            "name": "licensed",
            "resources": {"licence": 1},
            "tasks": [
                {"name": "a", "command": ["true"], "uses": ["licence"]},
                {"name": "b", "command": ["true"], "uses": ["licence"]},
            ],
        }
        await workflows.admit(b.store, wf, WorkflowSpec.parse(flow))
        a = await b.store.tasks.get(workflows.task_id(wf, "a"))
        bb = await b.store.tasks.get(workflows.task_id(wf, "b"))
        n1_silent_at = asyncio.get_running_loop().time() + ttl
        placed: list[tuple[str, list[str]]] = []

        async with b.store.transaction() as tx1:  # S1's pass: n1 is live, so it locks n1
            moved1, _ = await s1.dispatch.place(tx1, [a])
            placed.append(("S1", [f"{t.wf_task}@{t.node}" for t in moved1]))
            # meanwhile: n2 registers, n1's heartbeats stop (it goes past its TTL)
            await asyncio.sleep(max(0.0, n1_silent_at - asyncio.get_running_loop().time()) + 0.3)
            await b.store.nodes.register("n2", 2, 4.0, 0, 0, {"zone": "b"}, uuid4(), prefetch=0)

            async def second_pass() -> None:
                async with b.store.transaction() as tx2:  # S2's pass: only n2 is live
                    moved2, _ = await s2.dispatch.place(tx2, [bb])
                    placed.append(("S2", [f"{t.wf_task}@{t.node}" for t in moved2]))

            # bounded: a pass that waited for S1's locks would time out here (and be right)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(second_pass(), 5)
        held = await b.store.workflows.resources_held([wf])
        rows = await pool.fetch(
            "SELECT wf_task, status, node FROM tasks WHERE workflow_id = $1 ORDER BY wf_task", wf
        )
        units, capacity = held[(wf, "licence")]
        assert units <= capacity, (
            f"licence of capacity {capacity} held by {units} tasks: "
            f"{[(r['wf_task'], r['status'], r['node']) for r in rows]} (passes: {placed})"
        )


async def test_a_pass_that_releases_nothing_reads_no_upstreams_output(
    store: Store,
) -> None:
    """edges_of (sql/workflows.sql) returned u.result for every edge of every candidate, before
    anything was decided. A task still waiting for one upstream had the outputs of all its
    finished upstreams read and decoded again on every pass that looked at it: every NOTIFY of
    any of its upstreams and every sweep (SKED_RECONCILE_S). 30 tasks waiting on 4 finished
    ~1 MiB upstreams and one paused one: a pass that moves nothing reads ~125 MB. The cost is
    (waiting tasks) x (finished upstreams) x (output size): a fan-in of 1,000 x 1 MiB reads
    ~1 GB each time one more upstream ends (quadratic over the fan-in), and a sweep page of
    10,000 such tasks is tens of GB — the scheduler is OOM-killed, on every replica alike."""
    import tracemalloc

    ups = [f"u{i}" for i in range(4)]
    wf = uuid4()
    flow = {
        "name": "waits",
        "tasks": [{"name": u, "handler": "m:f"} for u in [*ups, "slow"]]
        + [{"name": f"d{j}", "handler": "m:f", "needs": [*ups, "slow"]} for j in range(30)],
    }
    await workflows.admit(store, wf, WorkflowSpec.parse(flow))
    for u in ups:
        await _run_to(store, workflows.task_id(wf, u), State.SUCCESS, result={"blob": "x" * BLOB})
    page = await store.workflows.pending_with_deps(10_000)
    assert len(page) == 30
    tracemalloc.start()
    try:
        ready, ended = await asyncio.wait_for(workflows.resolve(store, page), 120)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (ready, ended) == ([], [])  # nothing decided: `slow` has not finished
    assert peak < 16 * 1024 * 1024, (
        f"a pass that decided none of 30 waiting tasks peaked at {peak / 1e6:.0f} MB of Python "
        "memory: it read every finished upstream's output for every waiting task"
    )


async def test_canceling_a_big_workflow_reads_only_its_open_tasks_moves(
    store: Store, queue: ReadyQueue
) -> None:
    """cancel_workflow / pause_workflow / resume_workflow (shared/control.py) started from
    store.workflows.get: every task's WHOLE row (result, inputs, log tail, spec) for the
    workflow, re-read on each of up to 20 attempts, to find the few that are still open. In a
    big workflow whose finished tasks returned outputs (each up to 1 MiB, plus a 64 KiB log
    tail), an operator's cancel of the last open task reads ~40 MB here for 40 finished
    tasks; a 5,000-task workflow is gigabytes in the API or CLI process, per attempt."""
    import tracemalloc

    from shared import control

    names = [f"t{i}" for i in range(40)]
    wf = uuid4()
    flow = {
        "name": "big",
        "tasks": [{"name": n, "handler": "m:f"} for n in [*names, "open"]],
    }
    await workflows.admit(store, wf, WorkflowSpec.parse(flow))
    for n in names:
        await _run_to(store, workflows.task_id(wf, n), State.SUCCESS, result={"blob": "x" * BLOB})
    tracemalloc.start()
    try:
        canceled = await asyncio.wait_for(
            control.cancel_workflow(store, queue, wf, "stop", by="ops"), 60
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [t.wf_task for t in canceled] == ["open"]
    assert peak < 16 * 1024 * 1024, (
        f"canceling the one open task of a 41-task workflow peaked at {peak / 1e6:.0f} MB: "
        "every finished task's result was read to find it"
    )


async def test_a_workflow_cancel_of_over_a_thousand_tasks_releases_no_always_task(
    store: Store, queue: ReadyQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/architecture.md: 'Pending tasks are paused or canceled with the rest, so nothing
    downstream is released afterwards, `always` edges included.' That held only within one
    statement: cancel_workflow moved WORKFLOW_BATCH (1,000) tasks a statement, each its own
    transaction, in name order. When an upstream is in an earlier batch than its `always`
    downstream, the upstream's Canceled commits first, its NOTIFY wakes the resolver, and the
    resolver (another process: it may run between any two of cancel's statements) releases
    the downstream — Pending -> Ready, into the queue, free to be placed and started — before
    the next batch reaches it. Here the resolver runs exactly in that gap."""
    from shared import control

    fillers = [f"m{i:04d}" for i in range(1000)]
    wf = uuid4()
    flow = {
        "name": "big",
        "tasks": [{"name": "a", "command": ["true"]}]
        + [{"name": n, "command": ["true"]} for n in fillers]
        + [
            {
                "name": "zz_cleanup",
                "command": ["true"],
                "needs": [{"task": "a", "condition": "always"}],
            }
        ],
    }
    await workflows.admit(store, wf, WorkflowSpec.parse(flow))
    cleanup = workflows.task_id(wf, "zz_cleanup")

    from shared.store.tasks import Tasks

    real = Tasks.transition_many
    calls = 0
    resolver: asyncio.Task[Any] | None = None

    async def between_statements(self: Tasks, moves: Any) -> Any:
        nonlocal calls, resolver
        out = await real(self, moves)
        calls += 1
        if calls == 1:  # cancel's first statement is done: a resolver's pass runs now
            candidates = await store.workflows.downstream_of([workflows.task_id(wf, "a")])
            resolver = asyncio.create_task(workflows.resolve(store, candidates))
            await asyncio.wait([resolver], timeout=1.0)  # it decides now, or waits for cancel
        return out

    monkeypatch.setattr(Tasks, "transition_many", between_statements)
    await asyncio.wait_for(control.cancel_workflow(store, queue, wf, "stop", by="ops"), 60)
    assert resolver is not None
    await asyncio.wait_for(resolver, 30)
    monkeypatch.undo()

    history = await store.tasks.history(cleanup)
    path = [State.parse(e.to_status).label for e in history]
    assert "Ready" not in path, (
        f"`zz_cleanup` (always after `a`) was released while its workflow was being canceled: "
        f"{path}"
    )


async def test_a_dependency_that_timed_out_under_default_stands_when_it_later_fails(
    store: Store, pool: asyncpg.Pool
) -> None:
    """`report` needs `slow` (timeout_s 0.3, on_timeout: default, default {"rows": 0}) and
    `other` (no timeout). `slow` overruns: the resolver records the timeout
    (task_deps.timed_out_at, the next event names it) and `report` keeps waiting for `other`
    only — per the docs it now "goes on with its default". Then `slow` fails for good before
    `other` ends. shared/workflows.resolve computes the policy only `if not finished`, so the
    recorded timeout is forgotten and the on_success edge to a Failed upstream skips `report`.
    Had `other` ended a moment earlier, `report` would have run with the default: the
    outcome depends on the order two unrelated upstreams end, and a recorded decision
    ("timed out, go on with the default") is silently revoked — the operator who configured a
    fallback gets a Skipped report.

    Now a timeout recorded while the upstream ran stands when it ends without success; a
    success hands on its real output instead."""
    wf = uuid4()
    flow = {
        "name": "fallback",
        "tasks": [
            {"name": "slow", "command": ["true"]},
            {"name": "other", "command": ["true"]},
            {
                "name": "report",
                "command": ["true"],
                "needs": [
                    {
                        "task": "slow",
                        "timeout_s": 0.3,
                        "on_timeout": "default",
                        "default": {"rows": 0},
                    },
                    "other",
                ],
            },
        ],
    }
    await workflows.admit(store, wf, WorkflowSpec.parse(flow))
    slow, other, report = (workflows.task_id(wf, n) for n in ("slow", "other", "report"))
    for t in (slow, other):
        task = await store.tasks.get(t)
        task = await fsm.apply(store.tasks, task, State.SCHEDULING, node="n1")
        await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(uuid4()))
    await asyncio.sleep(0.6)  # `slow` overran its dependency timeout
    await workflows.resolve(store, [report])
    assert (await store.tasks.get(report)).status is State.PENDING  # still waits for `other`
    rows = await pool.fetch(
        "SELECT timed_out_at FROM task_deps WHERE task_id = $1 AND upstream_id = $2", report, slow
    )
    assert rows, "the edge exists"
    assert rows[0]["timed_out_at"] is not None, "the timeout was recorded"
    # `slow` fails for good (max_retries 0), then `other` succeeds
    task = await store.tasks.get(slow)
    await fsm.apply(store.tasks, task, State.FAILED, error="boom")
    await workflows.resolve(store, [report])
    task = await store.tasks.get(other)
    await fsm.apply(store.tasks, task, State.SUCCESS, result={"exit_code": 0})
    await workflows.resolve(store, [report])
    final = await store.tasks.get(report)
    assert final.status is State.READY, (
        f"the dependency on `slow` timed out under policy default (recorded), yet `report` "
        f"ended {final.status.label}: {final.status_reason!r}"
    )
    assert final.inputs == {"slow": {"rows": 0}, "other": None}, final.inputs
