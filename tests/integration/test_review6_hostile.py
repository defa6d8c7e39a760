"""A review of the fifteenth session's own bounds in the Postgres connection layer (a2ed2b2,
382d103): the executor's statement bound (db.pooled, wiring.node_statement_s) and the services'
idle-in-transaction bound (wiring.idle_in_tx_s). Each case failed on that code (the docstrings
say what happened and what should); each test shows it no longer does: a batch given up at the
bound is split (resilience.isolate, StatementOverran), a statement given up does not wait on
in its server backend (client_connection_check_interval), and a workflow's rows are built
before its transaction opens."""

from __future__ import annotations

import asyncio
import contextlib
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
from shared.settings import Settings
from shared.wiring import backends, idle_in_tx_s, node_statement_s
from tests.fakes import StubMessage
from tests.helpers import spec

ROW_S = 0.3  # what the server takes for each task row updated, once slowed


@pytest.fixture
async def executor(settings: Settings, tmp_path: Path) -> AsyncIterator[Executor]:
    """An executor wired as services/executor/__main__.py wires it (its pool's statement
    bound: node_statement_s), on a node TTL of 2 s: a statement is given up at 1 s."""
    node = settings.model_copy(
        update={"node_id": "n1", "slots": 8, "node_ttl_s": 2.0, "node_heartbeat_s": 0.5}
    )
    async with backends(node, idle_in_tx_s(node), node_statement_s(node)) as b:
        yield Executor(node, b.store, b.bus, LocalBackend(8, tmp_path), b.ready_queue)


async def running(executor: Executor, name: str, **kw: Any) -> Task:
    task = await executor.store.tasks.create(spec(name, **kw))
    for target in (State.PENDING, State.READY, State.SCHEDULING):
        task = await fsm.apply(executor.store.tasks, task, target)
    return await fsm.apply(
        executor.store.tasks, task, State.RUNNING, lease_owner=str(executor.node.boot_id)
    )


async def slow_rows(pool: asyncpg.Pool, row_s: float) -> None:
    """The server takes `row_s` for each task row updated (a busy server, a slow disk)."""
    await pool.execute(
        f"""CREATE FUNCTION probe_slow() RETURNS trigger LANGUAGE plpgsql AS
            $$ BEGIN PERFORM pg_sleep({row_s}); RETURN NEW; END $$"""
    )
    await pool.execute(
        "CREATE TRIGGER probe_slow BEFORE UPDATE ON tasks FOR EACH ROW"
        " EXECUTE FUNCTION probe_slow()"
    )


async def test_a_finish_batch_over_the_statement_bound_is_split_not_retried_whole(
    executor: Executor, pool: asyncpg.Pool
) -> None:
    """Eight failures end together on a server that takes 0.3 s a row: the transaction that
    writes them (Finisher.write: ends and retries commit together) runs a statement of 2.4 s,
    over the executor's statement bound (1 s here, half the node TTL; 5 s by default). db.pooled
    drops the connection, so Postgres rolls the transaction back, and the overrun raises
    asyncio's TimeoutError, which is TRANSIENT, so
    resilience.isolate re-raises it and `retrying` runs the same whole batch again — for ever:
    the outcomes are never written, the tasks stay Running, the dispatches unacknowledged.
    isolate splits a batch whose statement Postgres canceled (QueryCanceledError: "a batch too
    big to finish in the server's time was retried whole, for ever") but not one the client's
    new bound gave up. It should split it the same way (each row alone takes 0.3 s): all eight
    end Failed within a few seconds."""
    tasks = [await running(executor, f"t{i}") for i in range(8)]
    await slow_rows(pool, ROW_S)
    batch = [
        (Attempt(t, StubMessage(b"")), Outcome(False, None, f"exit {i}", False, False, ""))  # type: ignore[arg-type]
        for i, t in enumerate(tasks)
    ]
    finishing = asyncio.create_task(executor.finisher.finish(batch))
    try:
        done, _ = await asyncio.wait({finishing}, timeout=20)
    finally:
        executor.node.stopping.set()
        if not finishing.done():
            finishing.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(finishing, 30)
    states = [(await executor.store.tasks.get(t.id)).status for t in tasks]
    assert done, f"the outcomes' write still retried after 20 s; tasks: {states}"
    assert states == [State.FAILED] * 8


async def test_a_workflow_of_the_largest_allowed_size_is_admitted(settings: Settings) -> None:
    """A chain of 100,000 tasks — dag.WorkflowSpec's own bound (tasks: max_length=100_000);
    its message, ~6 MB, needs SKED_MAX_MESSAGE_BYTES raised to carry it — admitted by
    workflows.admit on a store wired as the scheduler's (serving's default: idle_in_tx_s, half
    the node TTL, 5 s). admit builds the next batch in Python inside its one transaction: after
    the roots' create_many, `[t.spec() for t in group]` for 99,999 dependents and their
    encoding take over 5 s, during which the session sits idle in the transaction, so Postgres
    ends it (IdleInTransactionSessionTimeoutError / ConnectionDoesNotExistError). That is
    TRANSIENT: the intake nacks its batch with requeue (services/scheduler/intake.py, and every
    submission batched with it), so the workflow is redelivered and fails the same way for ever.
    It was admitted before a2ed2b2. It should be admitted: the bound must not fall on Python
    work a service does inside a transaction on purpose (build the batches before opening it,
    or set a longer idle bound for that transaction: SET LOCAL
    idle_in_transaction_session_timeout)."""
    from uuid import uuid4

    from shared import workflows
    from shared.dag import WorkflowSpec
    from shared.wiring import connect_store

    n = 100_000
    spec_ = WorkflowSpec.parse(
        {
            "name": "big",
            "tasks": [
                {"name": f"t{i}", "command": ["true"], **({"needs": [f"t{i - 1}"]} if i else {})}
                for i in range(n)
            ],
        }
    )
    store = await connect_store(settings, idle_s=idle_in_tx_s(settings))
    try:
        # ~50 s on a slow host alone (~0.5 ms a task): bounded well inside pytest's 300 s,
        # as a loaded CI run may take twice that; the defect was an error, not the time
        ready = await asyncio.wait_for(workflows.admit(store, uuid4(), spec_), 200)
    finally:
        await store.close()
    assert [t.name for t in ready] == ["t0"]


async def test_statements_given_up_do_not_pile_up_on_the_server(
    executor: Executor, dsn: str
) -> None:
    """An operator's migration holds the nodes table (LOCK TABLE ... ACCESS EXCLUSIVE, as an
    ALTER TABLE does) longer than the executor's statement bound (1 s here; 5 s by default).
    Each node heartbeat gives up at the bound: db.pooled terminates its connection at once and
    expires the pool. asyncpg's cancel request for the overrun statement is dropped with the
    connection (terminate cancels its pending cancel task), and Postgres does not notice a
    vanished client while its backend waits for a lock: every heartbeat given up leaves a
    backend behind, still queued on the lock, and the retry opens a new connection. Six tries
    leave six backends waiting; an executor's loops retrying every few seconds, times every
    executor, reach max_connections while the lock is held, and then no service can connect.
    Before 382d103 the timeout's cancel request was delivered (the connection was given back
    only once the cancel was acknowledged): no backend stayed. A statement given up should be
    canceled on the server (pg_cancel_backend, or send the cancel before terminating)."""
    holder = await asyncpg.connect(dsn)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE nodes IN ACCESS EXCLUSIVE MODE")
            for _ in range(6):
                with pytest.raises(TimeoutError):
                    await executor.store.nodes.heartbeat("n1", executor.node.boot_id, 0.0)
            await asyncio.sleep(1.0)  # a cancel request on its way has had ample time
            waiting = await holder.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
    finally:
        await holder.close()
    assert waiting == 0, f"{waiting} backends of heartbeats given up still wait on the lock"
