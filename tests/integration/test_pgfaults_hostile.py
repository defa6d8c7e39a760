"""How services classify and survive Postgres's own errors: a database that refuses new
connections for a moment (ALLOW_CONNECTIONS false, SQLSTATE 55000, as maintenance, a restore
or a switchover does), and a statement_timeout a batch outgrows. Only the test's own
database is altered, and it is restored on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from services.executor.backends import Outcome
from services.executor.backends.local import LocalBackend
from services.executor.node import Attempt
from services.executor.service import Executor
from services.scheduler.service import Scheduler
from shared import fsm
from shared.bus import SUBMIT_KEY
from shared.client import SkedClient
from shared.errors import NotFound
from shared.fsm import State
from shared.resilience import TRANSIENT
from shared.settings import Settings
from shared.wiring import backends
from tests.conftest import PG_ADMIN
from tests.fakes import StubMessage
from tests.helpers import eventually, spec

OTHERS = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1"


def dbname(dsn: str) -> str:
    return urlsplit(dsn).path.lstrip("/")


@contextlib.asynccontextmanager
async def refusing_connections(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """The test's own database refuses new connections (ALLOW_CONNECTIONS false, what an
    operator's maintenance or a database being restored looks like: SQLSTATE 55000) and every
    session on it is ended, so that each pool has to connect again. Undone on exit."""
    db = dbname(dsn)
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await admin.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')
        await admin.execute(OTHERS, db)
        await asyncio.sleep(0.5)  # every client has seen its session end
        yield admin
    finally:
        await admin.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')
        await admin.close()


async def test_the_scheduler_rides_out_a_database_refusing_connections_for_a_moment(
    settings: Settings,
) -> None:
    """A scheduler runs; its database stops accepting connections for a few seconds
    (ALLOW_CONNECTIONS false: every reconnect fails with SQLSTATE 55000, "database ... is not
    currently accepting connections") and its sessions are ended; three tasks are submitted
    meanwhile. Should: the service rides the outage out like any other (README: "riding out
    server outages"), logs it, and admits the three tasks once connections are allowed again.
    resilience.TRANSIENT did not list 55000, so the first loop to reconnect raised it out of
    `supervise` and the whole scheduler exited; the tasks were never admitted. Now every
    connection a service makes goes through store.db.connect, which turns Postgres's
    refusal of a connection into ConnectRefused, a connection error retried like any."""
    fast = settings.model_copy(update={"reconcile_s": 0.3})
    async with backends(fast) as b, SkedClient(fast) as client:
        scheduler = Scheduler(fast, b.store, b.bus, b.ready_queue)
        running = asyncio.create_task(scheduler.run())
        try:
            await asyncio.wait_for(scheduler.ready.wait(), 30)
            async with refusing_connections(fast.database_url):
                ids = await client.submit_many(
                    [
                        {"name": f"t{i}", "job": {"kind": "command", "argv": ["true"]}}
                        for i in range(3)
                    ]
                )
                await asyncio.sleep(3.0)
            await asyncio.sleep(0.5)
            dead = [d.reason for d in await client.dead_letters(100)]
            assert dead == [], f"submissions dead-lettered for a database outage: {dead}"

            async def admitted() -> bool:
                assert not running.done(), f"the scheduler stopped: {running.exception()!r}"
                found = 0
                for i in ids:
                    with contextlib.suppress(NotFound):
                        await b.store.tasks.get(i)
                        found += 1
                return found == len(ids)

            await eventually(admitted, timeout=20, what="the three submissions admitted")
            assert not running.done(), f"the scheduler stopped: {running.exception()!r}"
        finally:
            scheduler.stop()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(running, 30)


def _allow_connections_sql(db: str) -> list[str]:
    return [
        "psql",
        "-X",
        "-q",
        "-h",
        "127.0.0.1",
        "-U",
        "postgres",
        "-d",
        "postgres",
        "-c",
        f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true',
    ]


class _LiftFaultOn(logging.Handler):
    """When a record starting with `prefix` is logged, lift the fault at once (synchronously,
    before the code that logged goes on): the outage is momentary, and ends right there."""

    def __init__(self, prefix: str | tuple[str, ...], db: str) -> None:
        super().__init__()
        self.prefix, self.db, self.fired = prefix, db, 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.prefix) and not self.fired:
            self.fired += 1
            subprocess.run(_allow_connections_sql(self.db), check=True, timeout=30)


async def test_a_success_is_recorded_success_when_its_write_meets_a_refused_connection(
    settings: Settings, tmp_path: Path
) -> None:
    """An executor's attempt succeeded (result 42); as its outcome is written the database
    refuses new connections for a moment (ALLOW_CONNECTIONS false, SQLSTATE 55000) and the
    pool's sessions were ended, so the write has to reconnect. Should: the outage is a
    server being away: the outcome write is retried (resilience.retrying) and the task ends
    Success with its result. `isolate` took the failed connect for a poisoned outcome and
    wrote a failure in its place: the task that succeeded was recorded Failed, "outcome
    could not be stored". Now a refused connection is ConnectRefused, transient: the batch
    waits for the server, whole."""
    node = settings.model_copy(update={"node_id": "n1", "slots": 1})
    db = dbname(settings.database_url)
    async with backends(node) as b:
        executor = Executor(node, b.store, b.bus, LocalBackend(1, tmp_path), b.ready_queue)
        task = await b.store.tasks.create(spec("ok"))
        for target in (State.PENDING, State.READY, State.SCHEDULING):
            task = await fsm.apply(b.store.tasks, task, target)
        task = await fsm.apply(
            b.store.tasks, task, State.RUNNING, lease_owner=str(executor.node.boot_id)
        )
        # the first line about the write lifts the fault: the finisher's failure (the defect)
        # or the retry's warning (the write waits for the server, as it should)
        lift = _LiftFaultOn(("the outcome of", "finish: "), db)
        logging.getLogger("services.executor.finish").addHandler(lift)
        logging.getLogger("shared.resilience").addHandler(lift)
        try:
            async with refusing_connections(settings.database_url):
                await asyncio.wait_for(
                    executor.finisher.finish(
                        [
                            (
                                Attempt(task, StubMessage(b"")),
                                Outcome(True, 42, None, False, False, ""),
                            )
                        ]  # type: ignore[arg-type]
                    ),
                    30,
                )
        finally:
            logging.getLogger("services.executor.finish").removeHandler(lift)
            logging.getLogger("shared.resilience").removeHandler(lift)
        got = await b.store.tasks.get(task.id)
        assert (got.status, got.result, got.error) == (State.SUCCESS, 42, None), (
            f"a success was recorded {got.status.value}: {got.error or got.status_reason}"
        )


async def test_intake_hands_a_submission_back_when_postgres_refuses_a_connection(
    settings: Settings,
) -> None:
    """Intake takes a batch of one valid submission while the database refuses new
    connections (ALLOW_CONNECTIONS false, SQLSTATE 55000: maintenance, a restore) and its
    sessions were ended. Should: a server being away hands the batch back to RabbitMQ to be
    delivered again (Intake.accept's docstring: "Only a server being away (a transient
    error) hands the whole batch back"); nothing is dead-lettered. `isolate` took the
    connect failure for that submission's fault: it was dead-lettered and its message
    acknowledged, the producer's task never created. Now ConnectRefused is transient."""
    async with backends(settings) as b, SkedClient(settings) as client:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        body = json.dumps({"name": "t", "job": {"kind": "command", "argv": ["true"]}}).encode()
        message = StubMessage(body, routing_key=SUBMIT_KEY, message_id="m-1")
        async with refusing_connections(settings.database_url):
            with contextlib.suppress(*TRANSIENT):  # handed back: what should happen
                await asyncio.wait_for(scheduler.intake.accept([message]), 30)  # type: ignore[list-item]
        dead = [d.reason for d in await client.dead_letters(100)]
        assert dead == [], f"a submission was dead-lettered for a refused connection: {dead}"
        assert message.acked == 0, "the submission was acknowledged, not handed back"


async def test_a_batch_of_outcomes_past_statement_timeout_is_split_not_retried_whole(
    settings: Settings, tmp_path: Path
) -> None:
    """The database has an operator's statement_timeout of 100 ms (set on the database: an
    ordinary guard). One success with a large result (~0.8 MB of JSON, under the 1 MiB
    limit) is written alone within it (checked first). Then an executor writes one batch of
    eight such successes and a small one, as the finisher batches what ended together.
    Should: the batch that outgrows the timeout is split (isolate's promise: "One poisoned
    item can never stop the rest"), and every outcome lands, each of them fitting alone.
    57014 query_canceled is transient, so `isolate` re-raised it and `retrying` sent the
    same whole batch again, for ever: none of the nine was written and the finisher was
    wedged. Now `isolate` splits a canceled batch, and retries only a canceled single."""
    node = settings.model_copy(update={"node_id": "n1", "slots": 2})
    db = dbname(settings.database_url)
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        async with backends(node) as b:
            executor = Executor(node, b.store, b.bus, LocalBackend(1, tmp_path), b.ready_queue)
            tasks = []
            for n in range(10):
                task = await b.store.tasks.create(spec(f"t{n}"))
                for target in (State.PENDING, State.READY, State.SCHEDULING):
                    task = await fsm.apply(b.store.tasks, task, target)
                tasks.append(
                    await fsm.apply(
                        b.store.tasks, task, State.RUNNING, lease_owner=str(executor.node.boot_id)
                    )
                )

            def big() -> Outcome:
                return Outcome(True, list(range(120_000)), None, False, False, "")

            def at(task: Any) -> Attempt:
                return Attempt(task, StubMessage(b""))  # type: ignore[arg-type]

            # One big outcome alone, timed without a timeout: the timeout is then four times
            # that (at least 100 ms), which one fits and eight together do not, however busy
            # the host (a fixed 100 ms failed the single write on a loaded CI host).
            began = time.monotonic()
            await asyncio.wait_for(executor.finisher.finish([(at(tasks[0]), big())]), 20)
            timeout_ms = max(100, int(4000 * (time.monotonic() - began)))
            assert (await b.store.tasks.get(tasks[0].id)).status is State.SUCCESS
            await admin.execute(f'ALTER DATABASE "{db}" SET statement_timeout = {timeout_ms}')
            await admin.execute(OTHERS, db)
            await asyncio.sleep(0.5)
            small = Outcome(True, 1, None, False, False, "")
            batch = [(at(t), big()) for t in tasks[1:9]] + [(at(tasks[9]), small)]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(executor.finisher.finish(batch), 12)
            await admin.execute(f'ALTER DATABASE "{db}" RESET statement_timeout')
            states = [(await b.store.tasks.get(t.id)).status.value for t in tasks[1:]]
            assert states == ["success"] * 9, f"outcomes not written within 12 s: {states}"
    finally:
        await admin.execute(f'ALTER DATABASE "{db}" RESET statement_timeout')
        await admin.close()


async def test_a_bounded_pool_gives_up_a_connect_to_a_silent_server_within_its_bound() -> None:
    """A pool with a statement bound (the executor's: half the node TTL) opening a connection
    to a server that accepts and never answers (a link gone silent, a NAT that dropped its
    state, a half-dead failover target) waited asyncpg's own connect timeout, 60 s: after
    `pooled` dropped a silent connection, the retry's fresh connect held the executor's node
    heartbeat and outcomes that long. Now the connect is bounded by the pool's statement
    bound but never below db.CONNECT_S (10 s, as long as a service's start waits: a connect
    takes several round trips), and gives up as a TimeoutError (transient: retried)."""
    from shared.store import db

    accepted: list[asyncio.StreamWriter] = []

    async def silent(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(w)  # held open, never answered

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    started = time.monotonic()
    try:
        async with asyncio.timeout(30):
            with pytest.raises(TimeoutError):
                await db.create_pool(f"postgresql://postgres@127.0.0.1:{port}/x", statement_s=1.0)
            taken = time.monotonic() - started
    finally:
        for w in accepted:
            w.close()
        server.close()
    assert taken < db.CONNECT_S + 5, f"the connect waited {taken:.1f} s, past {db.CONNECT_S} s"
