"""The executor's outcome write on real Postgres: a write retried after its COMMIT went through
(the reply lost) is not mistaken for a late result, for a success or a failure; a genuinely
superseded attempt is kept, not applied; what a task hands back, however hostile, is written;
and two attempts of one task in one batch do not break the batch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from services.executor.backends import Outcome
from services.executor.backends.local import LocalBackend
from services.executor.node import Attempt
from services.executor.service import Executor
from shared import fsm
from shared.fsm import State
from shared.models import Task
from shared.outcome import Report
from shared.settings import Settings
from shared.store.tasks import Tasks
from shared.wiring import backends
from tests.fakes import StubMessage
from tests.helpers import spec


@pytest.fixture
async def executor(settings: Settings, tmp_path: Path) -> AsyncIterator[Executor]:
    node = settings.model_copy(update={"node_id": "n1", "slots": 1})
    async with backends(node) as b:
        yield Executor(node, b.store, b.bus, LocalBackend(1, tmp_path), b.ready_queue)


async def running(executor: Executor, name: str, **kw: Any) -> Task:
    task = await executor.store.tasks.create(spec(name, **kw))
    for target in (State.PENDING, State.READY, State.SCHEDULING):
        task = await fsm.apply(executor.store.tasks, task, target)
    return await fsm.apply(
        executor.store.tasks, task, State.RUNNING, lease_owner=str(executor.node.boot_id)
    )


async def late_rows(pool: asyncpg.Pool) -> list[Any]:
    return list(await pool.fetch("SELECT task_id, attempt, ok FROM late_results"))


def attempt(task: Task) -> Attempt:
    return Attempt(task, StubMessage(b""))  # type: ignore[arg-type]


async def test_a_retried_write_after_a_lost_reply_is_not_late(
    executor: Executor, pool: asyncpg.Pool
) -> None:
    mine, failing = await running(executor, "mine"), await running(executor, "failing")
    moved_on = await running(executor, "moved-on")
    ok = Report(ok=True, result=42)
    bad = Report(ok=False, error="exit code 3")
    batch = [(attempt(mine), ok), (attempt(failing), bad)]

    assert await executor.finisher.write(batch, []) == []
    # the same write again, as after a lost COMMIT reply: it loses its CAS to itself — also
    # the failure, whose event reason goes on with its error
    assert await executor.finisher.write(batch, []) == []
    assert await late_rows(pool) == []
    assert (await executor.store.tasks.get(mine.id)).result == 42
    assert (await executor.store.tasks.get(failing.id)).status is State.FAILED

    # an attempt that lost its task to someone else (canceled) is kept, not applied, and its
    # lease given back: the process is gone
    await fsm.apply(executor.store.tasks, moved_on, State.CANCELED, reason="operator")
    assert (await executor.store.tasks.get(moved_on.id)).lease_attempt == 1  # Canceled keeps it
    late = await executor.finisher.write([(attempt(moved_on), ok)], [])
    assert [t.id for t, _ in late] == [moved_on.id]
    assert [(r["task_id"], r["attempt"], r["ok"]) for r in await late_rows(pool)] == [
        (moved_on.id, 1, True)
    ]
    after = await executor.store.tasks.get(moved_on.id)
    assert after.status is State.CANCELED
    assert (after.lease_owner, after.lease_attempt, after.lease_until) == (None, None, None)


async def test_hostile_outcomes_are_written_and_the_rest_of_the_batch_lands(
    executor: Executor,
) -> None:
    tasks = [await running(executor, f"t{i}") for i in range(5)]
    outcomes = [
        Outcome(True, float("nan"), None, False, False, ""),  # NaN: refused, clearly
        Outcome(True, {"k\x00": "v\ud800"}, None, False, False, "a\x00b\udcff"),  # escaped
        Outcome(True, "x" * (2 * 1024 * 1024), None, False, False, ""),  # too large
        Outcome(False, None, "boom\x00" * 1000, False, False, ""),  # a long error with NULs
        Outcome(True, 7, None, False, False, "fine"),
    ]
    await executor.finisher.finish([(attempt(t), o) for t, o in zip(tasks, outcomes, strict=True)])
    nan, escaped, large, long_error, fine = [await executor.store.tasks.get(t.id) for t in tasks]
    assert (nan.status, nan.result) == (State.FAILED, None)
    assert nan.error is not None
    assert nan.error.startswith("result cannot be stored: nan is not a JSON number")
    assert escaped.status is State.SUCCESS
    assert escaped.result == {"k\\0": "v\\ud800"}
    assert escaped.log_tail == "a\\0b\\udcff"
    assert large.status is State.FAILED
    assert large.error is not None
    assert "over the limit of 1048576" in large.error
    assert long_error.status is State.FAILED
    assert long_error.error is not None
    assert len(long_error.error) <= 2000
    assert long_error.error.endswith("…[cut]")
    assert (fine.status, fine.result, fine.log_tail) == (State.SUCCESS, 7, "fine")


async def test_two_attempts_of_one_task_in_one_batch(
    executor: Executor, pool: asyncpg.Pool
) -> None:
    first = await running(executor, "retried", max_retries=1)
    # attempt 1 is declared lost and retried; attempt 2 runs here too; both end together
    ended = await fsm.apply(executor.store.tasks, first, State.FAILED, reason="test")
    waiting = await fsm.apply(executor.store.tasks, ended, State.RETRY_WAIT, retry_in_s=0)
    ready = await fsm.apply(executor.store.tasks, waiting, State.READY)
    scheduled = await fsm.apply(executor.store.tasks, ready, State.SCHEDULING)
    second = await fsm.apply(
        executor.store.tasks, scheduled, State.RUNNING, lease_owner=str(executor.node.boot_id)
    )
    ok = Outcome(True, 1, None, False, False, "")
    await executor.finisher.finish([(attempt(second), ok), (attempt(first), ok)])
    final = await executor.store.tasks.get(first.id)
    assert (final.status, final.attempt) == (State.SUCCESS, 2)
    assert [(r["attempt"], r["ok"]) for r in await late_rows(pool)] == [(1, True)]


async def test_an_outcome_postgres_refuses_fails_alone(
    executor: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever still fails a batch for one row's sake (here: a statement error made to happen
    for one task) is found by halving the batch: that task fails with the reason, the rest of
    the batch lands."""
    tasks = [await running(executor, f"t{i}") for i in range(6)]
    poison = tasks[3].id
    real = Tasks.transition_many

    async def refusing(self: Tasks, moves: Any) -> list[Task]:
        if any(m.task_id == poison and m.patch.get("result") == "poison" for m in moves):
            raise asyncpg.exceptions.DataError("invalid input for this row")
        return await real(self, moves)

    monkeypatch.setattr(Tasks, "transition_many", refusing)
    outcomes = [
        Outcome(True, "poison" if t.id == poison else i, None, False, False, "")
        for i, t in enumerate(tasks)
    ]
    await executor.finisher.finish([(attempt(t), o) for t, o in zip(tasks, outcomes, strict=True)])
    final = {t.id: await executor.store.tasks.get(t.id) for t in tasks}
    assert final[poison].status is State.FAILED
    assert (
        final[poison].error == "outcome could not be stored: DataError: invalid input for this row"
    )
    assert [final[t.id].status for t in tasks if t.id != poison] == [State.SUCCESS] * 5


async def test_a_renewal_whose_lease_is_over_by_its_reply_tells_the_backend_nothing(
    executor: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal Postgres confirms, but whose reply comes after the lease it buys has run out
    (this executor froze, or the round trip took that long), must not reach the attempt's
    shim: telling it a lease of no time would thaw a frozen tree whose successor may run.
    One in time is told with what is left."""
    task = await running(executor, "renewed", heartbeat_timeout_s=1.0)
    key = (task.id, task.attempt)
    executor.node.active[key] = attempt(task)
    told: list[tuple[Any, float]] = []
    monkeypatch.setattr(executor.node.backend, "renew", lambda k, s: told.append((k, s)))
    watcher = executor.watcher
    try:
        assert await watcher.renew_once(timeout=5) == 1
        assert [k for k, _ in told] == [key]
        assert 0 < told[0][1] < 1.0
        told.clear()
        real = watcher._leases.renew

        async def slow(*args: Any) -> Any:
            renewed = await real(*args)
            await asyncio.sleep(1.0)  # the reply read after the whole lease (1 s) has passed
            return renewed

        monkeypatch.setattr(watcher._leases, "renew", slow)
        assert await watcher.renew_once(timeout=5) == 1  # Postgres did renew it
        assert told == []
    finally:
        watcher.close()
