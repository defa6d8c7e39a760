"""The schedule-to-start timeout against real Postgres: when the deadline is set (and what keeps
it), the sweep's claim (due or not, Ready or Scheduling, never Running), its index, its race
with an executor's start claim, and a workflow downstream of a task it failed."""

from __future__ import annotations

import asyncio
import random
from uuid import UUID, uuid4

import asyncpg
import pytest

from shared import control, dag, fsm, workflows
from shared.dag import WorkflowSpec
from shared.errors import StaleWrite
from shared.fsm import State
from shared.models import Task
from shared.outcome import not_started
from shared.store import STARTED_CHANNEL, TAKEN_CHANNEL, TASK_CHANNEL, Store, parse_notify
from shared.store.queries import Q
from shared.views import is_done
from tests.helpers import spec

REASON = "not started within 2 s (schedule_timeout_s)"


async def ready(store: Store, name: str = "t", **kw: object) -> Task:
    (task, _), *_ = await store.tasks.admit_many(
        [spec(name, **kw)], [uuid4()], (State.PENDING, State.READY)
    )
    return task


async def placed(store: Store, name: str = "t", **kw: object) -> Task:
    task = await ready(store, name, **kw)
    moved: Task = await fsm.apply(store.tasks, task, State.SCHEDULING, node="n1")
    return moved


async def heard_on(conn: asyncpg.Connection, *channels: str) -> list[asyncio.Queue[str]]:
    """A queue per channel of the payloads `conn` hears on it."""
    queues: list[asyncio.Queue[str]] = []
    for channel in channels:
        queue: asyncio.Queue[str] = asyncio.Queue()
        await conn.add_listener(channel, lambda *args, q=queue: q.put_nowait(args[-1]))
        queues.append(queue)
    return queues


async def make_overdue(pool: asyncpg.Pool, *tasks: Task) -> None:
    """Move the deadlines into the past (Postgres time), rather than wait for them."""
    await pool.execute(
        "UPDATE tasks SET schedule_deadline = now() - interval '1 second' WHERE id = ANY($1)",
        [t.id for t in tasks],
    )


async def sweep(store: Store) -> list[Task]:
    return await store.claims.fail_unstarted(100, not_started)


async def test_the_deadline_is_set_on_entering_ready_and_kept_by_a_bounce(store: Store) -> None:
    plain = await ready(store, "plain")
    assert (plain.schedule_timeout_s, plain.schedule_deadline) == (None, None)
    task = await ready(store, schedule_timeout_s=2, max_retries=1)
    assert task.schedule_timeout_s == 2.0
    assert task.queued_at is not None
    assert task.schedule_deadline is not None
    assert (task.schedule_deadline - task.queued_at).total_seconds() == 2.0  # one now()
    first, queued = task.schedule_deadline, task.queued_at
    # Scheduling -> Ready (a dispatch not confirmed, a backlog handed back): it never
    # started, so it keeps its place in line, and the clock goes on
    task = await fsm.apply(store.tasks, task, State.SCHEDULING, node="n1")
    task = await fsm.apply(store.tasks, task, State.READY, reason="dispatch not confirmed")
    assert task.queued_at == queued
    assert task.schedule_deadline == first
    # started, failed, retried: RetryWait -> Ready starts a new clock
    task = await fsm.apply(store.tasks, task, State.SCHEDULING, node="n1")
    task = await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(uuid4()))
    task = await fsm.apply(store.tasks, task, State.FAILED, error="exit 1")
    task = await fsm.apply(store.tasks, task, State.RETRY_WAIT, retry_in_s=0)
    assert task.schedule_deadline == first  # not waiting to start: left as it was
    task = await fsm.apply(store.tasks, task, State.READY)
    assert task.queued_at is not None
    assert task.schedule_deadline is not None
    assert (task.schedule_deadline - task.queued_at).total_seconds() == 2.0
    assert task.schedule_deadline > first


async def test_the_notification_marks_the_tasks_that_have_a_deadline(
    store: Store, dsn: str
) -> None:
    """The timeout loop looks at its index only when a task with a deadline entered Ready:
    the NOTIFY of admission and of every CAS marks such tasks (`d:`)."""
    heard: asyncio.Queue[str] = asyncio.Queue()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.add_listener(TASK_CHANNEL, lambda *args: heard.put_nowait(args[-1]))
        plain = await ready(store, "plain")
        timed = await ready(store, schedule_timeout_s=2)
        await fsm.apply(store.tasks, timed, State.SCHEDULING, node="n1")
        payloads = [await asyncio.wait_for(heard.get(), 5) for _ in range(3)]
    finally:
        await conn.close()
    notices = [parse_notify(p) for p in payloads]
    assert [n.ids for n in notices] == [{plain.id}, {timed.id}, {timed.id}]
    assert [n.deadline_ids for n in notices] == [set(), {timed.id}, {timed.id}]
    assert payloads[1] == f"{timed.id}:{timed.version}:d:ready"


async def test_moves_that_take_an_attempt_away_are_told_on_their_own_channel(
    store: Store, dsn: str
) -> None:
    """The executors and recovery listen on sked_taken: only the moves into a state that
    takes a running attempt away reach them, in the payload sked_task carries."""
    conn = await asyncpg.connect(dsn)
    try:
        taken, everything = await heard_on(conn, TAKEN_CHANNEL, TASK_CHANNEL)
        task = await placed(store)
        task = await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(uuid4()))
        other = await placed(store, "other")
        async with store.transaction() as tx:  # one statement moving both, one taken away
            moved = await tx.tasks.transition_many(
                [
                    fsm.plan(task, State.CANCELED, "canceled by an operator"),
                    fsm.plan(other, State.READY, "dispatch not confirmed"),
                ]
            )
        assert len(moved) == 2
        # two admissions, two placements, the cancel's statement (the start: sked_started)
        heard = [await asyncio.wait_for(everything.get(), 5) for _ in range(5)]
        told = await asyncio.wait_for(taken.get(), 5)
    finally:
        await conn.close()
    assert taken.empty()  # the admissions, placements and start told nothing here
    canceled = next(t for t in moved if t.id == task.id)
    assert told == f"{task.id}:{canceled.version}:canceled"
    assert parse_notify(heard[-1]).ids == {task.id, other.id}


async def test_starts_alone_are_told_on_their_own_channel(store: Store, dsn: str) -> None:
    """A statement that moved tasks into Running only (an executor's claims) notifies on
    sked_started, not sked_task, which the scheduler and waiting clients listen on: a start
    frees, ends and decides nothing. A statement with any other move in it stays on sked_task."""
    conn = await asyncpg.connect(dsn)
    try:
        started, everything = await heard_on(conn, STARTED_CHANNEL, TASK_CHANNEL)
        first, second, third = [await placed(store, f"t{i}") for i in range(3)]
        for _ in range(6):  # the admissions' and placements' notifications
            await asyncio.wait_for(everything.get(), 5)
        owner = str(uuid4())
        claims = [fsm.plan(t, State.RUNNING, "started", lease_owner=owner) for t in (first, second)]
        first, second = await store.tasks.transition_many(claims)
        told = await asyncio.wait_for(started.get(), 5)
        assert parse_notify(told).ids == {first.id, second.id}
        assert parse_notify(told).states == {"running"}
        # an outcome and a claim in one statement, as an executor writes them under load
        mixed = [
            fsm.plan(first, State.SUCCESS, "done"),
            fsm.plan(third, State.RUNNING, "started", lease_owner=owner),
        ]
        await store.tasks.transition_many(mixed)
        told = await asyncio.wait_for(everything.get(), 5)
        assert parse_notify(told).states == {"success", "running"}
    finally:
        await conn.close()
    assert started.empty()
    assert everything.empty()


async def test_a_resume_starts_a_new_clock(store: Store) -> None:
    class NoQueue:
        async def push(self, tasks: object) -> None:
            return None

    task = await ready(store, schedule_timeout_s=2)
    await control.pause(store, task.id, "hold on", by="test")
    resumed = await control.resume(store, NoQueue(), task.id)  # type: ignore[arg-type]
    assert resumed.status is State.READY
    assert resumed.schedule_deadline is not None
    assert task.schedule_deadline is not None
    assert resumed.schedule_deadline > task.schedule_deadline


async def test_the_sweep_fails_only_overdue_tasks_waiting_to_start(
    store: Store, pool: asyncpg.Pool
) -> None:
    due_ready = await ready(store, "due-ready", schedule_timeout_s=2, max_retries=3)
    due_placed = await placed(store, "due-placed", schedule_timeout_s=2)
    not_due = await ready(store, "not-due", schedule_timeout_s=60)
    without = await ready(store, "without")
    running = await placed(store, "running", schedule_timeout_s=2)
    running = await fsm.apply(store.tasks, running, State.RUNNING, lease_owner=str(uuid4()))
    await make_overdue(pool, due_ready, due_placed, running)
    assert await store.tasks.next_schedule_deadline() is not None
    assert (await store.tasks.next_schedule_deadline() or 0) < 0

    failed = {t.id: t for t in await sweep(store)}
    assert set(failed) == {due_ready.id, due_placed.id}
    for task in failed.values():
        assert task.status is State.FAILED
        assert task.retry_count == task.max_retries  # final: no retry spent or left
        assert (task.status_reason, task.error) == (REASON, REASON)
        assert task.finished_at is not None
        assert task.started_at is None
        assert is_done(task)
    assert failed[due_placed.id].node == "n1"
    history = await store.tasks.history(due_placed.id)
    assert [(e.from_status, e.to_status, e.reason) for e in history[-1:]] == [
        (State.SCHEDULING, State.FAILED, REASON)
    ]
    for other in (not_due, without, running):
        assert (await store.tasks.get(other.id)).status is other.status
    due_in = await store.tasks.next_schedule_deadline()
    assert due_in is not None
    assert 50 < due_in <= 60  # the not-due one's
    assert await sweep(store) == []


async def test_no_deadline_at_all_is_none(store: Store) -> None:
    await ready(store, "without")
    assert await store.tasks.next_schedule_deadline() is None


async def test_the_sweep_and_its_look_ahead_use_the_partial_index(
    store: Store, pool: asyncpg.Pool
) -> None:
    for i in range(20):
        await ready(store, f"t{i}", schedule_timeout_s=60)
    async with pool.acquire() as conn:
        await conn.execute("SET enable_seqscan = off")  # a tiny table: make the choice visible
        await conn.execute("ANALYZE tasks")
        for query, args in ((Q.claim_schedule_timed_out, (100,)), (Q.next_schedule_deadline, ())):
            plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN {query.sql}", *args))
            assert "tasks_schedule_deadline" in plan, plan


async def test_a_start_claim_holding_the_row_is_skipped_by_the_sweep(
    store: Store, pool: asyncpg.Pool
) -> None:
    task = await placed(store, schedule_timeout_s=30)
    await pool.execute(  # due in a moment, by Postgres's clock
        "UPDATE tasks SET schedule_deadline = now() + interval '0.5 second' WHERE id = $1",
        task.id,
    )
    start = fsm.plan(task, State.RUNNING, "started on n1", lease_owner=str(uuid4()))
    async with store.transaction() as tx:
        assert len(await tx.tasks.transition_many([start])) == 1  # holds the row until COMMIT
        await asyncio.sleep(1.0)  # the deadline passes meanwhile
        assert await sweep(store) == []  # SKIP LOCKED: not waited for, not failed
    assert (await store.tasks.get(task.id)).status is State.RUNNING
    assert await sweep(store) == []  # started: no longer waiting to start


async def test_no_attempt_is_placed_or_starts_past_its_deadline_whatever_the_sweep(
    store: Store, pool: asyncpg.Pool
) -> None:
    """Only the scheduler's sweep enforced the deadline: with it late (every scheduler down,
    or behind), an executor's claim of a dispatch it held in its backlog started the attempt
    a minute past its deadline (and then the sweep no longer saw it), and a pass placed an
    overdue task. The CAS now refuses both moves past the deadline, by Postgres's clock; the
    sweep fails the task as before."""
    task = await placed(store, "placed", schedule_timeout_s=2)
    waiting = await ready(store, "waiting", schedule_timeout_s=2)
    await make_overdue(pool, task, waiting)
    start = fsm.plan(task, State.RUNNING, "started on n1", lease_owner=str(uuid4()))
    async with asyncio.timeout(10):
        assert await store.tasks.transition_many([start]) == []
        with pytest.raises(StaleWrite):
            await fsm.apply(store.tasks, waiting, State.SCHEDULING, node="n1")
    assert {t.id for t in await sweep(store)} == {task.id, waiting.id}


async def test_a_start_claim_racing_the_sweep_loses_to_the_failed_move(
    store: Store, pool: asyncpg.Pool
) -> None:
    task = await placed(store, schedule_timeout_s=2)
    await make_overdue(pool, task)
    start = fsm.plan(task, State.RUNNING, "started on n1", lease_owner=str(uuid4()))
    async with store.transaction() as tx:
        failed = await tx.claims.fail_unstarted(10, not_started)
        assert [t.id for t in failed] == [task.id]
        # the executor's claim now waits for the row, then finds it moved on
        claim = asyncio.create_task(store.tasks.transition_many([start]))
        await asyncio.sleep(0.2)
        assert not claim.done()
    assert await asyncio.wait_for(claim, 10) == []
    after = await store.tasks.get(task.id)
    assert (after.status, after.started_at, after.lease_owner) == (State.FAILED, None, None)


async def test_many_claims_and_sweeps_at_once_end_each_task_one_way(
    store: Store, pool: asyncpg.Pool
) -> None:
    tasks = [await placed(store, f"t{i}", schedule_timeout_s=2) for i in range(40)]
    await make_overdue(pool, *tasks)
    owner = str(uuid4())

    async def claim(task: Task) -> None:
        await asyncio.sleep(random.uniform(0, 0.05))
        await store.tasks.transition_many(
            [fsm.plan(task, State.RUNNING, "started on n1", lease_owner=owner)]
        )

    async def sweeper() -> None:
        for _ in range(10):
            await store.claims.fail_unstarted(5, not_started)
            await asyncio.sleep(0.005)

    await asyncio.gather(*(claim(t) for t in tasks), sweeper(), sweeper())
    await sweep(store)  # whatever neither got to
    ends: dict[UUID, State] = {}
    for task in tasks:
        after = await store.tasks.get(task.id)
        assert after.status in (State.RUNNING, State.FAILED), after
        ends[task.id] = after.status
        targets = [e.to_status for e in await store.tasks.history(task.id)]
        assert targets[-1] is after.status
        assert (State.RUNNING in targets) != (State.FAILED in targets), targets
    assert set(ends.values()) <= {State.RUNNING, State.FAILED}


async def test_a_workflow_resolves_past_a_task_that_never_started(
    store: Store, pool: asyncpg.Pool
) -> None:
    wf = WorkflowSpec.parse(
        {
            "name": "wf",
            "tasks": [
                {"name": "stuck", "command": ["true"], "schedule_timeout_s": 2},
                {
                    "name": "cleanup",
                    "command": ["true"],
                    "needs": [{"task": "stuck", "condition": "on_failure"}],
                },
                {"name": "report", "command": ["true"], "needs": ["stuck"]},
            ],
        }
    )
    wf_id = uuid4()
    (stuck,) = await workflows.admit(store, wf_id, wf)
    assert stuck.schedule_deadline is not None  # a root: Ready at admission, its clock running
    await make_overdue(pool, stuck)
    assert [t.id for t in await sweep(store)] == [stuck.id]
    ids = {name: workflows.task_id(wf_id, name) for name in ("cleanup", "report")}
    released, ended = await workflows.resolve(store, list(ids.values()))
    assert [t.id for t in released] == [ids["cleanup"]]
    assert [(t.id, t.status) for t in ended] == [(ids["report"], State.SKIPPED)]


async def test_a_fan_in_too_wide_to_carry_fails_its_task_alone(
    store: Store, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outputs a task receives add up over its upstreams: past MAX_INPUTS_BYTES (here
    lowered to 1,000) the task fails with the reason instead of being released, and the other
    tasks resolved in the same pass go on."""
    monkeypatch.setattr(dag, "MAX_INPUTS_BYTES", 1000)
    wf = WorkflowSpec.parse(
        {
            "name": "wf",
            "tasks": [
                {"name": "a", "command": ["true"]},
                {"name": "b", "command": ["true"]},
                {"name": "wide", "command": ["true"], "needs": ["a", "b"]},
                {"name": "narrow", "command": ["true"], "needs": ["a"]},
            ],
        }
    )
    wf_id = uuid4()
    await workflows.admit(store, wf_id, wf)
    for name in ("a", "b"):  # each output fits; the two together do not
        await pool.execute(
            "UPDATE tasks SET status = 'success', result = $2::jsonb WHERE id = $1",
            workflows.task_id(wf_id, name),
            {"output": "x" * 600},
        )
    ids = {name: workflows.task_id(wf_id, name) for name in ("wide", "narrow")}
    released, ended = await workflows.resolve(store, list(ids.values()))
    assert [(t.id, t.inputs) for t in released] == [(ids["narrow"], {"a": "x" * 600})]
    (wide,) = ended
    assert (wide.id, wide.status) == (ids["wide"], State.FAILED)
    assert "over the limit of 1000" in (wide.error or "")
    assert (await store.tasks.history(wide.id))[-1].reason == wide.error
