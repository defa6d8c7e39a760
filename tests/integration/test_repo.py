"""The task store against real Postgres: races, side effects, batches, claims, reads."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import replace
from uuid import UUID

import asyncpg
import pytest

from shared import fsm, hooks
from shared.errors import IllegalTransition, InvalidSpec, NotFound, StaleWrite, UnknownState
from shared.fsm import State
from shared.models import Task, TaskSpec
from shared.store import Store, Tx, parse_notify
from shared.store.db import Db
from shared.store.notify import states_of
from shared.store.queries import Q
from shared.views import is_done
from tests.helpers import spec


async def counts(pool: asyncpg.Pool) -> tuple[int, int]:
    tasks = await pool.fetchval("SELECT count(*) FROM tasks")
    events = await pool.fetchval("SELECT count(*) FROM task_events")
    return tasks, events


async def test_create_records_the_created_event(store: Store) -> None:
    task = await store.tasks.create(spec("hello", priority=3, max_retries=2))
    assert (task.status, task.version, task.attempt, task.priority) == (State.CREATED, 1, 0, 3)
    history = await store.tasks.history(task.id)
    assert [(e.from_status, e.to_status, e.version) for e in history] == [(None, State.CREATED, 1)]


async def test_idempotency_key_gives_the_same_task(store: Store, pool: asyncpg.Pool) -> None:
    first = await store.tasks.create(spec("a", idempotency_key="k-1"))
    again = await store.tasks.create_many([spec("a", idempotency_key="k-1"), spec("b")])
    assert again[0].id == first.id
    assert again[1].id != first.id
    assert await counts(pool) == (2, 2)


async def test_fifty_racers_one_winner(store: Store, pool: asyncpg.Pool) -> None:
    """50 coroutines on 10 connections apply the same transition: exactly one wins."""
    task = await store.tasks.create(spec())
    assert pool.get_max_size() == 10

    async def racer() -> bool:
        try:
            await fsm.apply(store.tasks, task, State.PENDING, reason="race")
        except StaleWrite:
            return False
        return True

    results = await asyncio.gather(*(racer() for _ in range(50)))
    assert results.count(True) == 1
    after = await store.tasks.get(task.id)
    assert (after.status, after.version) == (State.PENDING, task.version + 1)
    rows = await pool.fetch(
        "SELECT * FROM task_events WHERE task_id = $1 AND to_status = 'pending'", task.id
    )
    assert len(rows) == 1


async def test_failing_side_effect_changes_nothing(store: Store, pool: asyncpg.Pool) -> None:
    task = await store.tasks.create(spec())
    before = await counts(pool)

    async def boom() -> None:
        raise RuntimeError("the backend refused")

    with pytest.raises(RuntimeError, match="refused"):
        await fsm.apply(store.tasks, task, State.PENDING, effect=boom)
    after = await store.tasks.get(task.id)
    assert after == task
    assert await counts(pool) == before


async def test_side_effect_runs_before_the_cas(store: Store) -> None:
    task = await store.tasks.create(spec())
    seen: list[State] = []

    async def look() -> None:
        seen.append((await store.tasks.get(task.id)).status)

    await fsm.apply(store.tasks, task, State.PENDING, effect=look)
    assert seen == [State.CREATED]


async def test_illegal_and_unknown_moves_write_nothing(store: Store, pool: asyncpg.Pool) -> None:
    task = await store.tasks.create(spec())
    before = await counts(pool)
    with pytest.raises(IllegalTransition, match="Created -> Running"):
        await fsm.apply(store.tasks, task, State.RUNNING)
    with pytest.raises(UnknownState, match="'exploded'"):
        await fsm.apply(store.tasks, task, "exploded")
    assert await store.tasks.get(task.id) == task
    assert await counts(pool) == before


async def test_terminal_task_rejects_every_move(store: Store, pool: asyncpg.Pool) -> None:
    task = await store.tasks.create(spec())
    task = await fsm.apply(store.tasks, task, State.CANCELED, reason="operator")
    before = await counts(pool)
    for target in State:
        with pytest.raises(IllegalTransition, match="Canceled -> "):
            await fsm.apply(store.tasks, task, target)
    assert await store.tasks.get(task.id) == task
    assert await counts(pool) == before


async def test_invalid_spec_is_a_clear_error(pool: asyncpg.Pool) -> None:
    before = await counts(pool)
    with pytest.raises(InvalidSpec, match=r"job\.command\.argv"):
        TaskSpec.parse({"name": "x", "job": {"kind": "command", "argv": []}})
    with pytest.raises(InvalidSpec, match="priority"):
        TaskSpec.parse({"name": "x", "job": {"kind": "command", "argv": ["a"]}, "priority": "hi"})
    with pytest.raises(InvalidSpec, match="colour"):
        TaskSpec.parse({"name": "x", "job": {"kind": "command", "argv": ["a"]}, "colour": 1})
    with pytest.raises(InvalidSpec, match="handler"):
        TaskSpec.parse({"name": "x", "job": {"kind": "handler", "handler": "not a path"}})
    assert await counts(pool) == before


async def test_batched_moves_return_only_winners(store: Store, pool: asyncpg.Pool) -> None:
    tasks = await store.tasks.create_many([spec(f"t{i}") for i in range(100)])
    stale = tasks[:10]
    await store.tasks.transition_many([fsm.plan(t, State.PENDING) for t in stale])
    _, events_before = await counts(pool)
    moved = await store.tasks.transition_many([fsm.plan(t, State.PENDING) for t in tasks])
    assert len(moved) == 90
    assert {t.id for t in moved} == {t.id for t in tasks[10:]}
    assert all(t.status is State.PENDING and t.version == 2 for t in moved)
    _, events_after = await counts(pool)
    assert events_after - events_before == 90


class _Seeing(hooks.Hook):
    """Records what `transitions` hands a hook."""

    def __init__(self) -> None:
        self.seen: list[tuple[Task, fsm.Move]] = []

    def transitions(
        self, moved: Sequence[tuple[Task, fsm.Move]], start_ns: int, end_ns: int
    ) -> None:
        self.seen.extend(moved)


async def test_moves_that_want_no_row_back_are_named_by_id(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch mixing moves that want their rows back with moves that do not (an attempt's
    end beside the claims taking its slot): every winner is named in `ids`, the rows come back
    whole for the former only, and a loser is in neither. With a hook installed the hook sees
    every moved task: whole where its move asked for it, else the columns of hooks.SEEN —
    the rest is not read back for the hook either (metrics or tracing on cost no whole rows)."""
    for hook in (None, _Seeing()):
        monkeypatch.setattr(hooks, "installed", [] if hook is None else [hook])
        tasks = await store.tasks.create_many([spec(f"r{i}") for i in range(6)])
        stale = await store.tasks.transition_many([fsm.plan(tasks[5], State.PENDING)])
        assert [t.id for t in stale] == [tasks[5].id]
        if hook is not None:
            hook.seen.clear()
        moves = [
            replace(fsm.plan(t, State.PENDING), read_back=i % 2 == 0) for i, t in enumerate(tasks)
        ]
        moved = await store.tasks.transition_many(moves)
        assert moved.ids == {t.id for t in tasks[:5]}  # tasks[5] moved on: its CAS lost
        assert [t.id for t in moved] == [tasks[0].id, tasks[2].id, tasks[4].id]
        for row in moved:
            assert row == await store.tasks.get(row.id)  # whole, as a read gives it
            assert (row.status, row.version, row.spec.name) == (State.PENDING, 2, row.name)
        for t in tasks[:5]:
            assert (await store.tasks.get(t.id)).status is State.PENDING  # all were moved
        if hook is not None:
            assert [(t.id, m) for t, m in hook.seen] == [(m.task_id, m) for m in moves[:5]]
            for seen, move in hook.seen:
                whole = await store.tasks.get(seen.id)
                if move.read_back:
                    assert seen == whole
                    continue
                for column in Task.__dataclass_fields__:
                    expected = getattr(whole, column) if column in hooks.SEEN else None
                    assert getattr(seen, column) == expected, column
        # a single move returns its row whatever the move says
        one = await store.tasks.transition(
            replace(fsm.plan(moved[0], State.READY), read_back=False)
        )
        assert one is not None
        assert one.status is State.READY


async def test_patch_fields_and_retry_bookkeeping(store: Store) -> None:
    task = await store.tasks.create(spec(max_retries=1))
    for target in (State.PENDING, State.READY):
        task = await fsm.apply(store.tasks, task, target)
    [task] = await store.claims.pick_runnable(10, node="n1")
    assert (task.status, task.attempt, task.node) == (State.SCHEDULING, 1, "n1")
    task = await fsm.apply(store.tasks, task, State.RUNNING)
    task = await fsm.apply(store.tasks, task, State.FAILED, error="exit 1")
    # the delay travels as a duration: Postgres computes the due time on its own clock
    task = await fsm.apply(store.tasks, task, State.RETRY_WAIT, retry_in_s=30.0)
    assert (task.retry_count, task.error) == (1, "exit 1")
    assert task.next_retry_at is not None
    assert 29.0 < (task.next_retry_at - task.updated_at).total_seconds() <= 30.0
    due_in = await store.tasks.next_retry_due()
    assert due_in is not None
    assert 29.0 < due_in <= 30.0
    assert await store.claims.sweep_due_retries(10) == []  # not due yet
    task = await fsm.apply(store.tasks, task, State.PAUSED, reason="x", paused_by="me")
    assert task.paused_at == task.updated_at  # Postgres's time, not the caller's
    task = await fsm.apply(store.tasks, task, State.PENDING)
    task = await fsm.apply(store.tasks, task, State.READY)
    [task] = await store.claims.pick_runnable(10)
    assert task.attempt == 2
    task = await fsm.apply(store.tasks, task, State.RUNNING)
    task = await fsm.apply(store.tasks, task, State.FAILED, error="exit 1 again")
    assert task.retry_count == 1
    with pytest.raises(IllegalTransition, match="retries spent"):
        await fsm.apply(store.tasks, task, State.RETRY_WAIT)
    history = await store.tasks.history(task.id)
    assert [e.version for e in history] == list(range(1, task.version + 1))


async def test_retries_come_due_by_postgres_time(store: Store) -> None:
    task = await store.tasks.create(spec(max_retries=1))
    for target in (State.PENDING, State.READY, State.SCHEDULING, State.RUNNING, State.FAILED):
        task = await fsm.apply(store.tasks, task, target)
    task = await fsm.apply(store.tasks, task, State.RETRY_WAIT, retry_in_s=0.0)
    [task] = await store.claims.sweep_due_retries(10)
    assert task.status is State.READY
    [task] = await store.claims.pick_runnable(10)
    assert task.attempt == 2
    task = await fsm.apply(store.tasks, task, State.RUNNING)
    task = await fsm.apply(store.tasks, task, State.FAILED, error="exit 1 again")
    with pytest.raises(IllegalTransition, match="retries spent"):
        await fsm.apply(store.tasks, task, State.RETRY_WAIT)
    assert fsm.is_terminal(task.status, fsm.has_retry_left(task))
    history = await store.tasks.history(task.id)
    assert [e.version for e in history] == list(range(1, task.version + 1))


async def test_pick_runnable_order_and_no_double_pick(store: Store) -> None:
    specs = [spec(f"p{p}-{i}", priority=p) for i in range(20) for p in (0, 5, 1)]
    tasks = await store.tasks.create_many(specs)
    pend = await store.tasks.transition_many([fsm.plan(t, State.PENDING) for t in tasks])
    for t in pend:  # one at a time, so queued_at follows submission order
        await store.tasks.transition(fsm.plan(t, State.READY))
    picks = await asyncio.gather(*(store.claims.pick_runnable(7) for _ in range(10)))
    picked = [t for batch in picks for t in batch]
    assert len(picked) == 60
    assert len({t.id for t in picked}) == 60
    ordered = await _pick_all(store, specs)
    assert [t.priority for t in ordered] == sorted((t.priority for t in ordered), reverse=True)


async def _pick_all(store: Store, specs: list[TaskSpec]) -> list:
    tasks = await store.tasks.create_many(
        [s.model_copy(update={"name": s.name + "b"}) for s in specs]
    )
    for t in tasks:
        t = await store.tasks.transition(fsm.plan(t, State.PENDING))
        await store.tasks.transition(fsm.plan(t, State.READY))
    out = []
    while batch := await store.claims.pick_runnable(5):
        out.extend(batch)
    # FIFO within one priority
    for p in (0, 1, 5):
        names = [t.name for t in out if t.priority == p]
        assert names == [f"p{p}-{i}b" for i in range(20)]
    return out


async def test_reads(store: Store) -> None:
    a = await store.tasks.create(spec("a"))
    b = await store.tasks.create(spec("b"))
    await fsm.apply(store.tasks, b, State.PENDING)
    assert [t.id for t in await store.tasks.list_tasks(statuses=["Pending"])] == [b.id]
    assert [t.id for t in await store.tasks.list_tasks(name="a")] == [a.id]
    assert len(await store.tasks.list_tasks(limit=1)) == 1
    with pytest.raises(UnknownState):
        await store.tasks.list_tasks(statuses=["nope"])
    with pytest.raises(NotFound):
        await store.tasks.get(UUID(int=0))
    with pytest.raises(NotFound):
        await store.tasks.history(UUID(int=0))


async def _two_states_in_order(
    store: Store, pool: asyncpg.Pool, n: int, per_instant: int
) -> list[Task]:
    """`n` tasks named a and b in turn, every third Pending, the rest Created; created in
    order, oldest first, `per_instant` of them at each instant (ties, as a batch admits)."""
    made = [await store.tasks.create(spec("a" if i % 2 else "b")) for i in range(n)]
    for t in made[::3]:
        await fsm.apply(store.tasks, t, State.PENDING)
    await pool.execute(
        "UPDATE tasks SET created_at = now() - make_interval(secs => 60 - (u.i - 1) / $2)"
        " FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, i) WHERE tasks.id = u.id",
        [t.id for t in made],
        per_instant,
    )
    return made


async def test_list_merges_the_states_newest_first(store: Store, pool: asyncpg.Pool) -> None:
    """list_tasks reads each state's newest from its index and merges them: the order is by
    creation across states, a state named twice lists its tasks once, and the limit and the
    name hold over the merge."""
    # creation times interleaved across the two states, newest last
    made = await _two_states_in_order(store, pool, 6, per_instant=1)
    newest_first = [t.id for t in reversed(made)]
    assert [t.id for t in await store.tasks.list_tasks()] == newest_first
    assert [t.id for t in await store.tasks.list_tasks(limit=4)] == newest_first[:4]
    both = ["Pending", "created", "pending"]
    assert [t.id for t in await store.tasks.list_tasks(statuses=both)] == newest_first
    named = [t.id for t in await store.tasks.list_tasks(name="a", limit=2)]
    assert named == [t for t in newest_first if t in {m.id for m in made[1::2]}][:2]
    assert await store.tasks.list_tasks(statuses=[]) == []


async def test_pages_list_every_task_once_in_order(store: Store, pool: asyncpg.Pool) -> None:
    """Keyset paging: each page goes on after the last task of the one before, so the pages
    of any size join into the whole listing — across states, and through tasks that share a
    creation instant (a batch admitted in one statement), which only the id orders. A task
    created meanwhile shifts nothing; the cursor may be a task the filter leaves out; an
    unknown cursor is an error, not an empty page."""
    # three instants, three tasks each: ties inside each, and both states in each
    made = await _two_states_in_order(store, pool, 9, per_instant=3)
    for statuses in (None, ["Created"], ["Pending", "Created"]):
        for size in (1, 2, 4, 9):
            whole = [t.id for t in await store.tasks.list_tasks(statuses=statuses)]
            pending = {t.id for t in made[::3]}
            mine = {t.id for t in made if statuses != ["Created"] or t.id not in pending}
            assert mine <= set(whole)
            paged: list[UUID] = []
            after = None
            while page := await store.tasks.list_tasks(statuses, limit=size, after=after):
                assert len(page) <= size
                paged.extend(t.id for t in page)
                after = page[-1].id
                if len(paged) == 3:
                    await store.tasks.create(spec("meanwhile"))  # newer: on no page after
            assert paged == whole, (statuses, size)
    everything = await store.tasks.list_tasks()
    cursor = next(t for t in everything[3:] if t.status is State.CREATED)  # not listed below
    later = everything[everything.index(cursor) + 1 :]
    after_it = await store.tasks.list_tasks(statuses=["Pending"], after=cursor.id)
    assert after_it == [t for t in later if t.status is State.PENDING]
    assert after_it
    with pytest.raises(NotFound, match="to list after"):
        await store.tasks.list_tasks(after=UUID(int=7))


async def test_a_move_with_a_wrong_source_loses(store: Store) -> None:
    """The SQL guards status too: a Move built from a wrong snapshot cannot jump states."""
    task = await store.tasks.create(spec())
    forged = fsm.Move(task.id, task.version, State.PENDING, State.READY, "forged")
    assert await store.tasks.transition(forged) is None
    assert (await store.tasks.get(task.id)).status is State.CREATED


async def test_terminal_query_agrees_with_the_fsm(store: Store, pool: asyncpg.Pool) -> None:
    """`terminal_among` is fsm.is_terminal written in SQL; they must never disagree."""
    tasks = []
    for state in State:
        for retry_count in (0, 2):
            task = await store.tasks.create(spec(f"{state}-{retry_count}", max_retries=2))
            # test-only: put the row straight into each (state, retries) combination
            await pool.execute(
                "UPDATE tasks SET status = $2, retry_count = $3 WHERE id = $1",
                task.id,
                state.value,
                retry_count,
            )
            tasks.append(task.id)
    terminal = {t.id for t in await store.tasks.terminal_among(tasks)}
    for task in await store.tasks.get_many(tasks):
        assert (task.id in terminal) == is_done(task), (task.status, task.retry_count)


async def test_admission_walks_the_fsm_in_one_statement(store: Store, pool: asyncpg.Pool) -> None:
    first = spec("walk")
    task_id = UUID(int=42)
    [(task, created)] = await store.tasks.admit_many(
        [first], [task_id], (State.PENDING, State.READY)
    )
    assert created
    assert (task.status, task.version, task.attempt) == (State.READY, 3, 0)
    assert task.queued_at is not None
    history = await store.tasks.history(task_id)
    assert [(e.from_status, e.to_status, e.version) for e in history] == [
        (None, State.CREATED, 1),
        (State.CREATED, State.PENDING, 2),
        (State.PENDING, State.READY, 3),
    ]
    # a redelivered submission creates nothing and returns the task as it is
    [(again, created)] = await store.tasks.admit_many(
        [first], [task_id], (State.PENDING, State.READY)
    )
    assert (again, created) == (task, False)
    assert await counts(pool) == (1, 3)
    with pytest.raises(IllegalTransition, match="Created -> Running"):
        await store.tasks.admit_many([spec("bad")], [UUID(int=43)], (State.RUNNING,))
    assert await counts(pool) == (1, 3)


def test_notify_payloads_parse() -> None:
    a, b, c, d = (UUID(int=i) for i in range(1, 5))
    notice = parse_notify(f"{a}:3:ready {b}:7:w:success {c}:2:d:w:ready {d}:4:d:scheduling")
    assert notice.ids == {a, b, c, d}
    assert notice.states == {"ready", "success", "scheduling"}
    assert notice.workflow_ids == {b, c}  # marked: a workflow's task
    assert notice.deadline_ids == {c, d}  # marked: a task with a schedule deadline
    big = parse_notify("*:500:success,failed")
    assert big.ids is None
    assert big.states == {"success", "failed"}
    assert big.workflow_ids is None  # not listed: any of them may be a workflow's
    assert big.deadline_ids is None
    # the states alone, without a UUID built an entry: the same for sked's own payloads
    for payload in (f"{a}:3:ready {b}:7:w:success {c}:2:d:w:ready", "*:500:success,failed"):
        assert states_of(payload) == parse_notify(payload).states
    # an entry that is not sked's counts there (a wake-up for nothing, never one missed)
    assert states_of(f"{a}:3:ready x:1:success") == {"ready", "success"}
    assert parse_notify(f"{a}:3:ready x:1:success").states == {"ready"}


async def _blocked_on(pool: asyncpg.Pool, pid: int) -> bool:
    waiting = await pool.fetchval(
        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
    )
    return bool(waiting)


@pytest.mark.parametrize("statement", ["transition", "heartbeat"])
async def test_batches_lock_rows_in_id_order(
    store: Store, pool: asyncpg.Pool, statement: str
) -> None:
    """A batch locks its rows in id order whatever order it lists them: while it waits for a
    row another transaction holds, it holds none of the rows above it. So that holder can take
    one of those next and both go on: two batches over the same rows never deadlock (two
    schedulers' batches did, in CI, before this)."""
    # created high id first, so the table's physical order and the batch's order below both
    # visit the highest row first: whatever plan Postgres picks, only id order avoids it
    created = [await store.tasks.create(spec(f"t{i}"), UUID(int=i)) for i in (3, 2, 1)]
    running = []
    for task in created:
        for target in (State.PENDING, State.READY, State.SCHEDULING, State.RUNNING):
            task = await fsm.apply(store.tasks, task, target)
        running.append(task)
    low, mid, high = sorted(running, key=lambda t: t.id)
    async with pool.acquire() as holder, pool.acquire() as batcher:
        hold = holder.transaction()
        await hold.start()
        await holder.execute("SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE", mid.id)
        order = [high, mid, low]  # the reverse of id order
        if statement == "transition":
            batch = asyncio.ensure_future(
                Tx(Db(batcher, 0.5), 10.0).tasks.transition_many(
                    [fsm.plan(t, State.SUCCESS, "done") for t in order]
                )
            )
        else:
            batch = asyncio.ensure_future(
                batcher.fetch(
                    Q.apply_heartbeats.sql,
                    [t.id for t in order],
                    [t.attempt for t in order],
                    [1] * 3,
                )
            )
        pid = batcher.get_server_pid()
        for _ in range(200):
            if await _blocked_on(pool, pid):
                break
            await asyncio.sleep(0.01)
        assert await _blocked_on(pool, pid), "the batch never reached the held row"
        # the row above the held one is free: the holder takes it without waiting
        try:
            await holder.execute("SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE NOWAIT", high.id)
            free = True
        except asyncpg.LockNotAvailableError:
            free = False
        await (hold.commit() if free else hold.rollback())
        rows = await asyncio.wait_for(batch, 10)
    assert free, "the batch held a row above the one it waits for: lock order is not id order"
    assert len(rows) == 3


async def test_the_clis_quick_reads_match_the_store(
    store: Store, pool: asyncpg.Pool, dsn: str
) -> None:
    """`sked status` reads a task on a bare connection: through libpq (the row as one JSON
    object) or through asyncpg without a jsonb codec. The task each builds is the store's,
    field for field and type for type (UUIDs, times, floats, JSON, arrays); an unknown id is
    NotFound."""
    from shared.store import libpq
    from shared.store.quick import read_task, read_task_now

    task = await store.tasks.create(spec("quick"))
    await pool.execute(
        """UPDATE tasks SET result = '{"a": [1, 2.5, null], "s": "x"}', inputs = '{"up": 3}',
                  workflow_id = NULL, uses = '{gpu-pool,"a b"}', cpu = 2, timeout_s = 30,
                  lease_owner = gen_random_uuid(), lease_until = now() + interval '1.5 s',
                  started_at = '2026-01-02 03:04:05.1+05:30', error = 'x"y\\z'
           WHERE id = $1""",
        task.id,
    )
    want = await store.tasks.get(task.id)
    reads = [await read_task(dsn, task.id)]
    with contextlib.suppress(libpq.Unavailable):  # without it, asyncpg's read is the one
        reads.append(await asyncio.to_thread(read_task_now, dsn, task.id))
    for read in reads:
        assert read == want
        for name, value in vars(want).items():  # asyncpg's UUID is a subclass of uuid.UUID
            got = getattr(read, name)
            assert isinstance(got, type(value)) or isinstance(value, type(got)), name
        assert read.result == {"a": [1, 2.5, None], "s": "x"}
        assert read.inputs == {"up": 3}
    with pytest.raises(NotFound):
        await read_task(dsn, UUID(int=7))
    if len(reads) == 2:
        with pytest.raises(NotFound):
            await asyncio.to_thread(read_task_now, dsn, UUID(int=7))


async def test_a_paused_listener_hears_nothing_until_resumed(
    store: Store, pool: asyncpg.Pool
) -> None:
    """pause() returns once the connection no longer listens (UNLISTEN), so that neither it
    nor its backend is woken by the commits meanwhile; resume() returns once it listens again.
    What was notified while paused is not heard: that is the caller's to look for."""
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = store.listener([("sked_test_pause", lambda *a: heard.put_nowait(a[-1]))])
    stop = asyncio.Event()
    running = asyncio.create_task(listener.run(stop))
    try:
        await asyncio.wait_for(listener.connected.wait(), 10)
        await pool.execute("SELECT pg_notify('sked_test_pause', 'one')")
        assert await asyncio.wait_for(heard.get(), 5) == "one"
        await listener.pause()
        assert not listener.wanted
        await pool.execute("SELECT pg_notify('sked_test_pause', 'two')")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(heard.get(), 0.5)
        await listener.resume()
        await pool.execute("SELECT pg_notify('sked_test_pause', 'three')")
        assert await asyncio.wait_for(heard.get(), 5) == "three"
        assert heard.empty()
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)
