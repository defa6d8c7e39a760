"""Retention against real Postgres: which finished tasks go, with what, and what stays."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Sequence
from uuid import UUID, uuid4

import asyncpg
import pytest
from redis.asyncio import Redis

from services.executor.service import Executor
from services.recovery import service as recovery_service
from services.recovery.service import Recovery
from shared import hooks, workflows
from shared.client import SkedClient, WaitTimeout
from shared.dag import WorkflowSpec
from shared.errors import NotFound, Purged
from shared.fsm import State
from shared.models import task_id_for
from shared.queues import ReadyQueue
from shared.relay import OutboxRelay
from shared.settings import Settings
from shared.store import Store, libpq, quick
from shared.views import is_done
from tests.helpers import eventually, spec

HOUR = 3600.0
ONE = {"name": "a", "command": ["true"]}


async def put(
    pool: asyncpg.Pool,
    ids: Sequence[UUID],
    state: State,
    *,
    ended_s_ago: float | None = 2 * HOUR,
    retry_count: int = 0,
) -> None:
    """Test-only: put these rows straight into `state`, ended (finished_at) that long ago."""
    await pool.execute(
        "UPDATE tasks SET status = $2, retry_count = $3,"
        " finished_at = CASE WHEN $4::float8 IS NULL THEN NULL"
        " ELSE now() - make_interval(secs => $4::float8) END WHERE id = ANY($1::uuid[])",
        list(ids),
        state.value,
        retry_count,
        ended_s_ago,
    )


async def rows_of(pool: asyncpg.Pool, ids: Sequence[UUID]) -> dict[str, int]:
    """How many rows of each table still name these tasks."""
    tables = ("tasks", "task_events", "late_results", "task_deps")
    out = {}
    for table in tables:
        column = "id" if table == "tasks" else "task_id"
        out[table] = await pool.fetchval(
            f"SELECT count(*) FROM {table} WHERE {column} = ANY($1::uuid[])", list(ids)
        )
    return out


async def test_what_ends_for_good_goes_and_nothing_else(store: Store, pool: asyncpg.Pool) -> None:
    """Every state, with and without a retry left, ended two hours ago, against a retention
    of one hour: exactly the tasks the FSM calls terminal go (a Failed task with a retry
    left is about to be retried), with their history and late results. A task that ended
    within the hour stays."""
    tasks = {}
    for state in State:
        for retry_count in (0, 2):
            task = await store.tasks.create(spec(f"{state}-{retry_count}", max_retries=2))
            await put(pool, [task.id], state, retry_count=retry_count)
            tasks[task.id] = task
    recent = await store.tasks.create(spec("recent"))
    await put(pool, [recent.id], State.SUCCESS, ended_s_ago=60)
    never = await store.tasks.create(spec("never-finished"))
    await put(pool, [never.id], State.SUCCESS, ended_s_ago=None)
    await store.late.record([(t, 1, True, {"late": 1}, None, "superseded") for t in tasks])

    expected = {t.id for t in await store.tasks.get_many(list(tasks)) if is_done(t)}
    assert len(expected) == 8  # success, canceled, skipped x2; failed, timed_out spent
    deleted = await store.retention.purge_tasks(100, HOUR)
    assert set(deleted) == expected
    assert await rows_of(pool, deleted) == dict.fromkeys(
        ("tasks", "task_events", "late_results", "task_deps"), 0
    )
    kept = [t for t in tasks if t not in expected] + [recent.id, never.id]
    assert len(await store.tasks.get_many(kept)) == len(kept)
    assert (await rows_of(pool, kept))["task_events"] == len(kept)  # each its Created event
    assert await store.retention.purge_tasks(100, HOUR) == []


async def test_a_workflow_goes_whole_or_not_at_all(store: Store, pool: asyncpg.Pool) -> None:
    """A workflow's ended tasks stay while any task of it has not ended before the cutoff (a
    task downstream reads its upstreams' results); then the workflow goes whole, with its
    tasks, edges and history. A task ended alone beside it is not held back."""
    wf = WorkflowSpec.parse(
        {
            "name": "wf",
            "tasks": [
                {"name": "a", "command": ["true"]},
                {"name": "b", "command": ["true"], "needs": ["a"]},
            ],
        }
    )
    wf_id = uuid4()
    await workflows.admit(store, wf_id, wf)
    a, b = (workflows.task_id(wf_id, name) for name in ("a", "b"))
    await put(pool, [a], State.SUCCESS)  # b is Pending, waiting on a's result
    await pool.execute(
        "UPDATE workflows SET created_at = now() - interval '3 hours' WHERE id = $1", wf_id
    )
    assert await store.retention.purge_tasks(100, HOUR) == []
    purged = await store.retention.purge_workflows(10, HOUR)
    assert (purged.workflows, purged.tasks) == (0, 0)
    for ended_s_ago in (60, None):  # ended within the hour; ended, when not recorded
        await put(pool, [b], State.SUCCESS, ended_s_ago=ended_s_ago)
        purged = await store.retention.purge_workflows(10, HOUR)
        assert (purged.workflows, purged.tasks) == (0, 0)
    assert (await rows_of(pool, [a, b]))["task_deps"] == 1

    await put(pool, [b], State.SKIPPED)
    purged = await store.retention.purge_workflows(10, HOUR)
    assert (purged.workflows, purged.tasks) == (1, 2)
    assert await rows_of(pool, [a, b]) == dict.fromkeys(
        ("tasks", "task_events", "late_results", "task_deps"), 0
    )
    assert await pool.fetchval("SELECT count(*) FROM workflows WHERE id = $1", wf_id) == 0


async def test_replicas_share_the_purge(store: Store, pool: asyncpg.Pool) -> None:
    """Recovery's replicas purge at once: each task is deleted by exactly one of them."""
    made = await store.tasks.create_many([spec(f"t{i}") for i in range(300)])
    await put(pool, [t.id for t in made], State.SUCCESS)

    async def replica() -> list[UUID]:
        mine: list[UUID] = []
        while batch := await store.retention.purge_tasks(40, HOUR):
            mine += batch
        return mine

    shares = await asyncio.gather(*(replica() for _ in range(3)))
    every = [task_id for share in shares for task_id in share]
    assert len(every) == len(set(every)) == 300
    assert await pool.fetchval("SELECT count(*) FROM tasks") == 0


async def test_a_purged_tasks_key_and_late_result(store: Store, pool: asyncpg.Pool) -> None:
    """Once a task is purged its idempotency key is free (a submission with it is a new task),
    and a late result reported for it is dropped, not an error for the executor writing it."""
    first = await store.tasks.create(spec("keyed", idempotency_key="nightly-2026-12-06"))
    await put(pool, [first.id], State.SUCCESS)
    assert await store.retention.purge_tasks(10, HOUR) == [first.id]
    await store.late.record([(first.id, 1, True, {"x": 1}, None, "superseded")])
    assert await pool.fetchval("SELECT count(*) FROM late_results") == 0
    again = await store.tasks.create(spec("keyed", idempotency_key="nightly-2026-12-06"))
    assert again.id != first.id


async def test_a_purged_task_or_workflow_reads_and_waits_as_deleted(
    settings: Settings, store: Store, pool: asyncpg.Pool
) -> None:
    """Retention leaves a tombstone for each id it deletes: a read of the task or workflow
    says it was deleted (the CLI's quick read too), and a wait for it ends with that at once,
    where it waited until its timeout as for a task not admitted yet. A new task of the same
    id (its idempotency key is free again) is waited for as any other. One retention after
    the deletion the tombstone goes, and the id reads as never admitted."""
    keyed = spec("alone", idempotency_key=f"nightly-{uuid4()}")
    alone = await store.tasks.create(keyed, task_id_for(keyed))
    await put(pool, [alone.id], State.SUCCESS)
    wf_id = uuid4()
    await workflows.admit(store, wf_id, WorkflowSpec.parse({"name": "wf", "tasks": [ONE]}))
    member = workflows.task_id(wf_id, "a")
    await put(pool, [member], State.SUCCESS)
    await pool.execute("UPDATE workflows SET created_at = now() - interval '3 hours'")
    assert await store.retention.purge_tasks(10, HOUR) == [alone.id]
    assert (await store.retention.purge_workflows(10, HOUR)).tasks == 1

    for read in (
        store.tasks.get(alone.id),
        store.tasks.get(member),
        quick.read_task(settings.database_url, alone.id),
    ):
        with pytest.raises(Purged, match="deleted by retention"):
            await read
    with contextlib.suppress(libpq.Unavailable), pytest.raises(Purged, match="was deleted"):
        quick.read_task_now(settings.database_url, alone.id)
    with pytest.raises(Purged, match=f"workflow {wf_id} was deleted"):
        await store.workflows.get(wf_id)
    async with SkedClient(settings) as client:
        began = time.monotonic()
        with pytest.raises(Purged, match=f"task {alone.id} was deleted"):
            await client.wait(alone.id, timeout=30)
        with pytest.raises(Purged):
            await client.wait_workflow(wf_id, timeout=30)
        assert time.monotonic() - began < 10

        # the same id made again by its key: a task like any other, waited for until it ends
        again = await store.tasks.create_many([keyed], ids=[alone.id])
        assert [t.id for t in again] == [alone.id]
        with pytest.raises(WaitTimeout):
            await client.wait(alone.id, timeout=0.5)

    await pool.execute("UPDATE purged SET purged_at = now() - interval '2 hours'")
    assert await store.retention.purge_tombstones(10, HOUR) == 3  # alone, member, wf
    with pytest.raises(NotFound) as gone:
        await store.workflows.get(wf_id)
    assert not isinstance(gone.value, Purged)


@pytest.fixture
async def queue(redis_url: str) -> AsyncIterator[ReadyQueue]:
    redis = Redis.from_url(redis_url)
    yield ReadyQueue(redis, 5.0)
    await redis.aclose()


class Counting(hooks.Hook):
    def __init__(self) -> None:
        self.count = 0

    def purged(self, n: int) -> None:
        self.count += n


async def test_recovery_retains_in_a_loop_of_its_own(
    store: Store,
    pool: asyncpg.Pool,
    settings: Settings,
    queue: ReadyQueue,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off by default; with SKED_RETENTION_DAYS, recovery's retention loop deletes batch after
    batch while they come back full, counts what it deleted, and then looks again on its
    period: a task that ends later is deleted at a later look."""
    relay = OutboxRelay(store, None, 1)  # type: ignore[arg-type]
    assert [name for name, _ in Recovery(settings, store, queue, relay).loops()] == ["recovery"]
    kept_s = 0.5
    on = settings.model_copy(update={"retention_days": kept_s / 86_400, "retention_check_s": 0.2})
    recovery = Recovery(on, store, queue, relay)
    assert [name for name, _ in recovery.loops()] == ["recovery", "retention"]
    monkeypatch.setattr(recovery_service, "PURGE_TASKS", 4)
    counting = Counting()
    monkeypatch.setattr(hooks, "installed", [counting])

    made = await store.tasks.create_many([spec(f"t{i}") for i in range(10)])
    await put(pool, [t.id for t in made], State.SUCCESS)
    assert await recovery.purge() == (4, True)  # a full batch: more may wait
    alive = await store.tasks.create(spec("alive"))
    await put(pool, [alive.id], State.RUNNING, ended_s_ago=None)
    looping = asyncio.create_task(recovery.retain())
    try:
        await eventually(lambda: _counted(counting, 10), timeout=10, what="the backlog purged")
        assert await pool.fetchval("SELECT array_agg(id) FROM tasks") == [alive.id]
        await put(pool, [alive.id], State.CANCELED, ended_s_ago=0)  # ends now: gone a look later
        await eventually(lambda: _counted(counting, 11), timeout=10, what="a later look")
        assert await pool.fetchval("SELECT count(*) FROM tasks") == 0
    finally:
        recovery.stop()
        await asyncio.wait_for(looping, 5)


async def test_the_api_audit_goes_by_a_retention_of_its_own(
    store: Store,
    pool: asyncpg.Pool,
    settings: Settings,
    queue: ReadyQueue,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SKED_AUDIT_RETENTION_DAYS alone runs the retention loop: it deletes the API's audit
    rows recorded that long ago, in batches, and leaves younger rows and every task (whose own
    retention is off) alone."""
    relay = OutboxRelay(store, None, 1)  # type: ignore[arg-type]
    on = settings.model_copy(update={"audit_retention_days": HOUR / 86_400})
    recovery = Recovery(on, store, queue, relay)
    assert [name for name, _ in recovery.loops()] == ["recovery", "retention"]
    monkeypatch.setattr(recovery_service, "PURGE_ROWS", 2)
    ended = await store.tasks.create(spec("ended"))
    await put(pool, [ended.id], State.SUCCESS, ended_s_ago=100 * HOUR)
    for i in range(5):
        await store.tokens.audit("ci-bot", "submit", f"target-{i}")
    await pool.execute(
        "UPDATE api_audit SET at = now() - interval '2 hours'"
        " WHERE target IN ('target-0', 'target-1', 'target-2')"
    )

    assert await recovery.purge() == (0, True)  # a full batch: more may wait
    assert await recovery.purge() == (0, False)
    kept = await pool.fetch("SELECT target FROM api_audit ORDER BY target")
    assert [r["target"] for r in kept] == ["target-3", "target-4"]
    assert await store.tasks.get_many([ended.id]) != []


async def _counted(counting: Counting, n: int) -> bool:
    assert counting.count <= n
    return counting.count == n


async def test_an_executor_prunes_its_attempt_logs(executor: Executor) -> None:
    """With SKED_RETENTION_DAYS, an executor runs a retention loop of its own that deletes the
    log files its ended attempts left past the retention; off by default."""
    assert "retention" not in [name for name, _ in executor.loops()]
    kept_s = 100.0  # a look every tenth of a second: a thousandth of this
    executor.settings = executor.settings.model_copy(
        update={"retention_days": kept_s / 86_400, "retention_check_s": 0.01}
    )
    assert "retention" in [name for name, _ in executor.loops()]
    logs = executor.node.backend.state_dir / "logs"  # type: ignore[attr-defined]
    stale, fresh = logs / f"{uuid4()}-1.log", logs / f"{uuid4()}-1.log"
    for path in (stale, fresh):
        path.write_text("done")
    before = time.time() - 2 * kept_s
    os.utime(stale, (before, before))
    looping = asyncio.create_task(executor._retention_loop())
    try:
        await eventually(lambda: _gone(stale), timeout=10, what="the stale log pruned")
        assert fresh.exists()
    finally:
        executor.stop()
        await asyncio.wait_for(looping, 5)


async def _gone(path: os.PathLike[str]) -> bool:
    return not os.path.exists(path)
