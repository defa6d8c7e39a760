"""What every aggregate of the store runs its statements on: a pool (each statement on a
connection of its own, in its own transaction) or one connection inside a transaction."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit
from uuid import UUID

import asyncpg

from shared import hooks
from shared.errors import NotFound, StatementOverran, postgres_refused
from shared.errors import missing as missing_error
from shared.store.queries import Q, Query
from shared.task import Task


def named_dsn(dsn: str, name: str) -> str:
    """The database URL with its sessions named `name` (pg_stat_activity.application_name,
    `%a` in Postgres's log lines), so an operator can tell a scheduler's sessions from an
    executor's; a URL that names them already is left as it is. asyncpg passes a query
    parameter it does not know to the server as a setting, and libpq reads this one too."""
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        return dsn  # not a URL asyncpg reads: it would refuse it as it is
    if "application_name" in parse_qs(parts.query, keep_blank_values=True):
        return dsn
    # appended to the query as written: the operator's parameters are not re-encoded
    ours = f"application_name={quote(name)}"
    return urlunsplit(parts._replace(query=f"{parts.query}&{ours}" if parts.query else ours))


# The schema every session of sked works in, unless the database URL names its own search_path
# (`options=-c search_path=...`). Postgres's default, `"$user", public`, puts a schema named
# after the role first as soon as one is created: `CREATE TABLE IF NOT EXISTS` and every
# unqualified statement would then resolve there, to a second, empty set of tables.
SCHEMA = "public"


def pinned_dsn(dsn: str) -> str:
    """The database URL with its sessions' search_path set to SCHEMA (a startup option:
    asyncpg and libpq both pass the URL's `options` to the server), unless the URL sets a
    search_path already; the operator's other options are kept, and left as written."""
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        return dsn  # not a URL asyncpg reads: it would refuse it as it is
    pieces = parts.query.split("&") if parts.query else []
    ours = quote(f"-c search_path={SCHEMA}")
    for i, piece in enumerate(pieces):
        key, _, value = piece.partition("=")
        said = unquote(value.replace("+", " "))
        if key == "search_path" or (key == "options" and "search_path" in said):
            return dsn
        if key == "options":
            pieces[i] = f"{piece}%20{ours}"
            break
    else:
        pieces.append(f"options={ours}")
    return urlunsplit(parts._replace(query="&".join(pieces)))


async def init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _init_checking(conn: asyncpg.Connection) -> None:
    """A connection of a pool whose statements are given up at a bound (`pooled` drops the
    connection): Postgres checks each second that the client of a running statement is still
    there, so one given up while it waited on a lock does not wait on, holding a backend
    (each retry, on a new connection, left one more). Postgres 14 and later have the check."""
    await init_connection(conn)
    if conn.get_server_version().major >= 14:
        await conn.execute("SET client_connection_check_interval = '1s'")


async def _lean_reset(conn: asyncpg.Connection) -> None:
    """What a connection needs on its way back to the pool. asyncpg's default reset runs
    `pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL` — a round trip on every
    release, one in three of all statements under load. sked leaves no session state on a
    pooled connection: transactions end in their context managers, LISTEN has connections of
    its own, advisory locks are transaction-scoped (the gauges' session lock is released by
    its holder, shared/store/gauges.py), nothing is SET. A transaction left open (a task
    cancelled mid-statement) is still rolled back."""
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


class ConnectRefused(ConnectionError):
    """Postgres answered a new connection with a refusal — not accepting connections (a
    database being switched over), starting up, too many connections, a password a promoted
    standby does not know yet. To a service that is a server away, like a refused socket
    (an OSError: resilience.TRANSIENT), retried; it is never the fault of the batch whose
    statement needed the connection (resilience.isolate). The cause is Postgres's error."""


async def connect(dsn: str | None = None, **kwargs: Any) -> asyncpg.Connection:
    """asyncpg.connect, with Postgres's refusal of the connection as ConnectRefused; every
    connection a service makes goes through it (its pool's too)."""
    try:
        return await asyncpg.connect(dsn, **kwargs)
    except asyncpg.InvalidCatalogNameError:
        raise  # no such database: a setting to mend, named at start (shared.wiring)
    except asyncpg.PostgresError as exc:
        said = postgres_refused(str(exc), getattr(exc, "sqlstate", None))
        raise ConnectRefused(f"Postgres refused a new connection: {said}") from exc


COMMAND_S = 60.0  # a pooled statement's bound, unless its service sets one (create_pool)
CONNECT_S = 10.0  # the longest a service's start waits for a server's first answer (wiring)


async def create_pool(
    dsn: str,
    size: int = 8,
    idle_in_tx_s: float | None = None,
    statement_s: float = COMMAND_S,
) -> asyncpg.Pool:
    """A pool whose sessions Postgres ends when one sits `idle_in_tx_s` in an open
    transaction (None: never). Its holder frozen mid-transaction (SIGSTOP, a paused VM or
    container, a swap storm) kept that transaction's row locks for the whole freeze, and its
    own timeouts, counted by the frozen process, did not run: every move is a CAS, so a
    transaction ended this way is only run again by its holder, once it wakes.
    `statement_s` bounds each statement on it (asyncpg's command_timeout; a statement given
    a timeout of its own keeps it): one that overruns raises TimeoutError and its connection
    is dropped (`pooled`). Each connect it makes is bounded by that too, but never below
    CONNECT_S: a connect takes several round trips (TLS, authentication) where a statement
    takes one, and a server a service could start on must not fail its later connects
    (asyncpg's own bound, 60 s, held an executor's heartbeat that long after a silent
    connection was dropped)."""
    settings: dict[str, str] = {}
    if idle_in_tx_s is not None:
        settings["idle_in_transaction_session_timeout"] = str(max(1, round(idle_in_tx_s * 1000)))
    pool = await asyncpg.create_pool(
        pinned_dsn(dsn),
        min_size=1,
        max_size=size,
        init=init_connection if statement_s >= COMMAND_S else _init_checking,
        reset=_lean_reset,
        command_timeout=statement_s,
        timeout=max(CONNECT_S, min(statement_s, COMMAND_S)),  # each connect's
        connect=connect,
        server_settings=settings,
    )
    assert pool is not None
    return pool


@asynccontextmanager
async def pooled(
    pool: asyncpg.Pool, tx: bool = False, **options: Any
) -> AsyncIterator[asyncpg.Connection]:
    """A connection of `pool`, in a transaction if `tx` (`options`: its isolation, readonly),
    dropped — never given back — when a statement on it overran its bound (TimeoutError).
    asyncpg asks Postgres to cancel an overrun statement, on a connection of its own, and
    its pool takes the connection back only once the cancel is acknowledged on it: on one
    gone silent (a NAT that dropped its state: no FIN, no RST) that never comes, and the give
    back, with the TimeoutError behind it, waited out the cancel's own command_timeout
    (60 s: an executor's node heartbeat and outcomes stopped for a minute). A dropped
    connection's transaction is rolled back by Postgres (no ROLLBACK is sent on it: it would
    wait the same). The pool's other connections are suspect too (a link that silenced one
    silenced those opened beside it): each is replaced when next taken, so the retry does not
    meet another."""
    async with pool.acquire() as conn:
        try:
            if not tx:
                yield conn
                return
            xact = conn.transaction(**options)
            await xact.start()
            try:
                yield conn
            except TimeoutError:
                raise  # dropped below
            except BaseException:
                if not conn.is_closed():  # (Postgres ended the session: its error is the cause)
                    await xact.rollback()
                raise
            await xact.commit()
        except TimeoutError as exc:
            # its statement, if still waiting on the server (a lock), is ended there once the
            # server sees the socket closed (client_connection_check_interval, below)
            conn.terminate()
            await pool.expire_connections()
            raise StatementOverran(f"a statement overran its bound, given up: {exc}") from exc


class Db:
    """A pool, or a connection in a transaction; runs named statements on it."""

    def __init__(self, target: asyncpg.Pool | asyncpg.Connection, lease_margin_s: float) -> None:
        self.target = target
        self.lease_margin_s = lease_margin_s

    @property
    def in_transaction(self) -> bool:
        return isinstance(self.target, asyncpg.Connection)

    async def fetch(self, query: Query, *args: Any) -> list[asyncpg.Record]:
        return list(await self._run("fetch", query, args))

    async def fetchrow(self, query: Query, *args: Any) -> asyncpg.Record | None:
        row: asyncpg.Record | None = await self._run("fetchrow", query, args)
        return row

    async def fetchval(self, query: Query, *args: Any) -> Any:
        return await self._run("fetchval", query, args)

    async def execute(self, query: Query, *args: Any) -> str:
        status: str = await self._run("execute", query, args)
        return status

    async def _run(self, method: str, query: Query, args: tuple[Any, ...]) -> Any:
        """One statement: in this transaction, or on a pooled connection (`pooled`)."""
        if isinstance(self.target, asyncpg.Connection):
            return await getattr(self.target, method)(query.sql, *args)
        async with pooled(self.target) as conn:
            return await getattr(conn, method)(query.sql, *args)

    @asynccontextmanager
    async def atomic(self) -> AsyncIterator[Db]:
        """One transaction: a new one on a pooled connection, or the one already open."""
        if isinstance(self.target, asyncpg.Connection):
            yield self
            return
        with hooks.told_on_commit():  # Store.transaction says why
            async with pooled(self.target, tx=True) as conn:
                yield Db(conn, self.lease_margin_s)

    @asynccontextmanager
    async def snapshot(self) -> AsyncIterator[Db]:
        """Reads that see one snapshot (a read-only REPEATABLE READ transaction): a reader of
        several statements never sees a commit between them, such as a purge by retention.
        Inside a transaction already, that one."""
        if isinstance(self.target, asyncpg.Connection):
            yield self
            return
        async with pooled(self.target, tx=True, isolation="repeatable_read", readonly=True) as c:
            yield Db(c, self.lease_margin_s)


def task(row: asyncpg.Record) -> Task:
    return Task.from_row(row)


def tasks_of(rows: Sequence[asyncpg.Record]) -> list[Task]:
    """The tasks of one statement's rows (`Task.from_rows`: their columns read once)."""
    return Task.from_rows(rows)


async def get_task(db: Db, task_id: UUID) -> Task:
    """One task by id (Tasks.get, and shared.store.quick's read without the aggregates)."""
    row = await db.fetchrow(Q.get_task, task_id)
    if row is None:
        raise await missing(db, "task", task_id)
    return task(row)


async def missing(db: Db, what: str, ident: UUID) -> NotFound:
    """The error for a task or workflow id with no row: Purged when retention deleted it
    (and still remembers: table purged), else NotFound. Read only on a miss."""
    at = await db.fetchval(Q.purged_when, ident)
    return missing_error(what, ident, at)
