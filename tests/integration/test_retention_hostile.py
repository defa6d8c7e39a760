"""Retention and its tombstones (table purged, 0018) against what could race them: a key
submitted again while its old task's tombstone stands, a workflow submission delivered again
after its purge, a workflow read while its purge commits. Each test failed before its fix."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

import asyncpg
import pytest

from shared import workflows
from shared.client import SkedClient
from shared.dag import WorkflowSpec
from shared.errors import NotFound, Purged
from shared.fsm import State
from shared.models import task_id_for
from shared.settings import Settings
from shared.store import Store
from shared.store.db import Db
from shared.store.queries import Q, Query
from tests.helpers import spec
from tests.integration.test_retention import HOUR, ONE, put


async def test_a_wait_for_a_key_submitted_again_is_not_ended_by_the_old_tombstone(
    settings: Settings, store: Store, pool: asyncpg.Pool
) -> None:
    """README: once a task is purged "its idempotency key is free: a submission with it makes
    a new task". The new submission gets the very same id (uuid5 of the key), and the usual
    pattern is `id = await client.submit(spec); await client.wait(id)`. While that submission
    is still on its way through RabbitMQ (intake not there yet, or behind), the wait finds the
    old tombstone with no task of that id and raises Purged at once: "task X was deleted by
    retention" for a task that is about to be admitted and run. A nightly job keyed by date
    (or any producer that reuses keys) is told its fresh run was deleted; a CI step that
    treats Purged as failure fails, and nobody waits for the work that does run.

    Shown: purge a keyed task, submit the same key again through the client (the message sits
    in sked.submit), wait; the task is then admitted (as intake would) and ends Success. The
    wait must return it; it raises Purged instead.

    Now a client remembers the keyed ids it submitted (SkedClient._keyed), and its waits
    take no tombstone of theirs for an end. (A wait in another process still would: the
    submission and the tombstone meet nowhere before intake.)"""
    key = "nightly-2026-12-06"
    keyed = spec("nightly", idempotency_key=key)
    first = await store.tasks.create(keyed, task_id_for(keyed))  # as intake admits it
    await put(pool, [first.id], State.SUCCESS)
    assert await store.retention.purge_tasks(10, HOUR) == [first.id]

    async with SkedClient(settings) as client:
        again = await client.submit(spec("nightly", idempotency_key=key))
        assert again == first.id  # the key names the same id again: a new task, says README
        waiting = asyncio.create_task(client.wait(again, timeout=15))
        await asyncio.sleep(1.5)  # the submission still on its way to intake
        made = await store.tasks.create_many([spec("nightly", idempotency_key=key)], ids=[again])
        assert [t.id for t in made] == [again]
        await put(pool, [again], State.SUCCESS, ended_s_ago=0)
        async with asyncio.timeout(20):
            done = await waiting  # raises Purged now: the old tombstone answered the wait
        assert done.id == again
        assert done.status is State.SUCCESS


async def test_a_workflow_submission_delivered_again_after_its_purge_runs_again(
    store: Store, pool: asyncpg.Pool
) -> None:
    """A workflow's id is its submission's message id (the SDK's uuid4: task_id_for_workflow),
    so the same id can only come back as the same message: a redelivery, or an operator
    replaying sked.dead / a producer's outbox re-publishing. Admission is idempotent by that id
    ("nothing if one with this id exists (a redelivered submission)"), but once retention
    deleted the workflow the id is free, and the same message admits the whole workflow again:
    every task of it runs a second time (deploys, payments, emails), with a fresh history, and
    the tombstone that says this id was this submission, deleted, is right there and ignored.
    Unlike an idempotency key (README: free again by design), a message id stands for one
    submission and is never reused on purpose.

    Shown: a workflow admitted, ended, purged whole; the same submission admitted again. It
    must create nothing (or be refused); it makes its root task Ready again.

    Now insert_workflow creates nothing for an id with a tombstone, and admit treats it as
    the same submission again; so does admission for a task whose id is its message id."""
    wf = WorkflowSpec.parse({"name": "deploy", "tasks": [ONE]})
    wf_id = uuid4()
    await workflows.admit(store, wf_id, wf)
    await put(pool, [workflows.task_id(wf_id, "a")], State.SUCCESS)
    await pool.execute(
        "UPDATE workflows SET created_at = now() - interval '3 hours' WHERE id = $1", wf_id
    )
    assert (await store.retention.purge_workflows(10, HOUR)).workflows == 1

    async with asyncio.timeout(10):
        try:
            ready = await workflows.admit(store, wf_id, wf)  # the same message delivered again
        except Exception:  # refused: what the fix does
            ready = []
    assert ready == []
    assert await pool.fetchval("SELECT count(*) FROM tasks WHERE workflow_id = $1", wf_id) == 0


async def test_a_workflow_read_while_retention_commits_is_never_half_gone(
    store: Store, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """retention.sql promises "readers see it whole until the transaction commits", but
    Workflows.get (SkedClient.workflow, GET /v1/workflows/{id}, `sked workflow`,
    GET /v1/tasks?workflow=) reads the row, the tasks and the edges in three statements outside
    any transaction. When retention's purge of the workflow commits between the first and the
    second, the reader gets the workflow's row with no tasks and no edges: the API answers 200
    with `"tasks": []`, status of an empty workflow, counts {} — a workflow that apparently
    never had any work — instead of 410 (deleted by retention). A dashboard or script that
    reads it takes the empty answer for the truth.

    Shown: the purge is run (and committed) right after the row is read; the read must then
    either raise Purged or return the workflow whole (its one task); it returns it empty.

    Now Workflows.get reads the three in one snapshot (Db.snapshot: a read-only REPEATABLE
    READ transaction)."""
    wf_id = uuid4()
    await workflows.admit(store, wf_id, WorkflowSpec.parse({"name": "wf", "tasks": [ONE]}))
    member = workflows.task_id(wf_id, "a")
    await put(pool, [member], State.SUCCESS)
    await pool.execute(
        "UPDATE workflows SET created_at = now() - interval '3 hours' WHERE id = $1", wf_id
    )

    async def purge() -> None:
        assert (await store.retention.purge_workflows(10, HOUR)).workflows == 1

    real = Db.fetchrow
    purged = False

    async def fetchrow(self: Db, query: Query, *args: Any) -> asyncpg.Record | None:
        nonlocal purged
        row = await real(self, query, *args)
        if query is Q.get_workflow and not purged:  # the purge commits right after the row
            purged = True
            await purge()
        return row

    monkeypatch.setattr(Db, "fetchrow", fetchrow)
    async with asyncio.timeout(10):
        try:
            _row, tasks, _edges = await store.workflows.get(wf_id)
        except Purged:
            return  # the reader saw it gone: fine
    assert [t.id for t in tasks] == [member]  # whole, as it was: not a workflow of no tasks


async def test_a_task_submission_delivered_again_after_its_purge_runs_nothing(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """A plain task's id is its submission's message id (the SDK's uuid4: task_id_for), so,
    as with a workflow's, the same id can only come back as the same message: a redelivery
    (after a scheduler's crash between its commit and its ack), or an operator replaying a
    message. Admission creates nothing for an id that names a task; but once retention deleted
    the task, the same message made it again, and it ran a second time.

    Shown: a submission admitted by a running scheduler, its task ended two hours ago and
    purged; the same message published again. Nothing must be created, nothing dead-lettered
    (it is the same submission, already run), and the scheduler must live on. A keyed task's
    id is its key's, free again once purged (README): a keyed submission after its purge is
    still a new task."""
    from services.scheduler.service import Scheduler
    from shared.bus import SUBMIT_KEY
    from shared.models import TaskSpec
    from shared.wiring import backends
    from tests.helpers import eventually

    fast = settings.model_copy(update={"reconcile_s": 0.3})
    async with backends(fast) as b, SkedClient(fast) as client:
        scheduler = Scheduler(fast, b.store, b.bus, b.ready_queue)
        running = asyncio.create_task(scheduler.run())
        try:
            await asyncio.wait_for(scheduler.ready.wait(), 30)
            plain = TaskSpec.parse({"name": "pay", "job": {"kind": "command", "argv": ["true"]}})
            keyed = TaskSpec.parse(
                {
                    "name": "k",
                    "job": {"kind": "command", "argv": ["true"]},
                    "idempotency_key": uuid4().hex,
                }
            )
            first = task_id_for(plain)
            sent = [(plain.model_dump_json().encode(), first, "pay")]
            await client._publish(SUBMIT_KEY, sent)
            key_id = await client.submit(keyed)

            async def both_admitted() -> bool:
                n = await pool.fetchval(
                    "SELECT count(*) FROM tasks WHERE id = ANY($1::uuid[])", [first, key_id]
                )
                return n == 2

            await eventually(both_admitted, timeout=10, what="both admitted")
            await put(pool, [first, key_id], State.SUCCESS)
            assert {first, key_id} <= set(await b.store.retention.purge_tasks(10, HOUR))

            await client._publish(SUBMIT_KEY, sent)  # the same message again
            assert await client.submit(keyed) == key_id  # the key is free: a new task
            await eventually(
                lambda: pool.fetchval("SELECT count(*) FROM tasks WHERE id = $1", key_id),
                timeout=10,
                what="the keyed task made again",
            )
            await asyncio.sleep(1.0)  # dead letters are published after the batch's admission
            assert not running.done(), running
            assert await pool.fetchval("SELECT count(*) FROM tasks WHERE id = $1", first) == 0
            assert [d.reason for d in await client.dead_letters(1000)] == []
        finally:
            scheduler.stop()
            await asyncio.wait_for(running, 30)


async def test_a_workflow_never_makes_a_task_under_a_purged_plain_task_s_id(
    store: Store, pool: asyncpg.Pool
) -> None:
    """A workflow's task ids come from its id and its tasks' names, which a producer may know
    (and a plain task's id is whatever message id its producer set). A plain task made under
    such an id, run and purged, leaves a tombstone that admission will not create past; the
    workflow that names that task is then refused whole, saying why, not half made."""
    from shared.errors import InvalidSpec

    wf_id = uuid4()
    squatter = workflows.task_id(wf_id, "a")
    await store.tasks.create(spec("squat"), squatter)
    await put(pool, [squatter], State.SUCCESS)
    assert await store.retention.purge_tasks(10, HOUR) == [squatter]
    with pytest.raises(InvalidSpec, match="retention deleted"):
        await workflows.admit(store, wf_id, WorkflowSpec.parse({"name": "w", "tasks": [ONE]}))
    assert await pool.fetchval("SELECT count(*) FROM workflows WHERE id = $1", wf_id) == 0


async def test_a_page_after_a_cursor_retention_deleted_goes_on_from_where_it_stood(
    store: Store, pool: asyncpg.Pool
) -> None:
    """`sked list --after ID` / GET /v1/tasks?after=ID (and the same for workflows) page by the
    last id of the page before. When retention deleted that task or workflow between two
    pages (an operator paging back through old work is paging through what retention is
    deleting), the next page answered 404 ("no task ... to list after"): the listing could not
    go on at all. Now a tombstone keeps its row's creation time, and the next page goes on
    from where the deleted row stood."""
    old = [await store.tasks.create(spec(f"t{i}")) for i in range(3)]
    await pool.execute(
        "UPDATE tasks SET created_at = now() - make_interval(hours => (10 - n)::int)"
        " FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, n) WHERE tasks.id = u.id",
        [t.id for t in old],
    )
    newest_first = [t.id for t in reversed(old)]
    page = await store.tasks.list_tasks(limit=2)
    assert [t.id for t in page] == newest_first[:2]
    await put(pool, [page[-1].id], State.SUCCESS)  # the cursor's task ends and is purged
    assert await store.retention.purge_tasks(10, HOUR) == [page[-1].id]
    rest = await store.tasks.list_tasks(limit=2, after=page[-1].id)
    assert [t.id for t in rest] == newest_first[2:]
    assert await store.tasks.list_tasks(name="t2", after=page[-1].id) == []  # the last page
    with pytest.raises(NotFound, match="to list after"):
        await store.tasks.list_tasks(after=uuid4())  # an id never known is still refused

    flows = []
    for i in range(3):
        wf_id = uuid4()
        await workflows.admit(store, wf_id, WorkflowSpec.parse({"name": f"w{i}", "tasks": [ONE]}))
        flows.append(wf_id)
    await pool.execute(
        "UPDATE workflows SET created_at = now() - make_interval(hours => (10 - n)::int)"
        " FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, n) WHERE workflows.id = u.id",
        flows,
    )
    first = await store.workflows.page(2)
    assert [w.id for w in first] == flows[::-1][:2]
    # the cursor's workflow ends and is purged; the others have not ended
    await put(pool, [workflows.task_id(first[-1].id, "a")], State.SUCCESS)
    assert (await store.retention.purge_workflows(10, HOUR)).workflows == 1
    assert [w.id for w in await store.workflows.page(2, after=first[-1].id)] == [flows[0]]
