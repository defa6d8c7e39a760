"""Forward-only schema migrations: plain SQL files applied in order and recorded; then the
SQL functions the statements call are defined anew from the statements' own files.

`sked migrate` runs `migrate()`. Several processes may run it at once: a session advisory lock
serialises them, and each file is applied in its own transaction with its version recorded, so a
crash midway leaves the schema at the last whole version. A file's transaction waits at most
LOCK_TIMEOUT_S for any one lock (the services' writes queue behind that wait) and is tried again
later; a migrator frozen inside one is ended by Postgres after IDLE_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import unquote, urlsplit

import asyncpg

from shared.errors import SkedError
from shared.store.db import pinned_dsn
from shared.store.queries import Q

log = logging.getLogger(__name__)


# The functions statements call, (re)defined by every migrate from their text in sql/*.sql, so
# they are always those of the code that migrated last (CREATE OR REPLACE: idempotent).
FUNCTIONS = ("define_transition", "define_nodes", "define_admit")

# What `sked migrate` says on a server without autovacuum (tests/integration/test_migrate.py).
AUTOVACUUM_OFF = (
    "autovacuum is off on this server: every move of a task leaves a dead version of its row"
    " (~1 KB a task) that stays until a VACUUM, and the tasks table grows by it; turn"
    " autovacuum on or VACUUM tasks on a schedule (relays vacuum the outbox themselves:"
    " SKED_RELAY_VACUUM_ROWS)"
)

LOCK_TIMEOUT_S = 2.0  # one lock wait of a migration: every write to its table queues behind it
LOCK_RETRY_TOTAL_S = 300.0  # how long a file is tried again before migrate gives up
LOCK_RETRY_FIRST_S = 1.0  # the first pause between tries; doubled each time up to ..._MAX_S
LOCK_RETRY_MAX_S = 30.0
IDLE_TIMEOUT_S = 10.0  # a migrator idle inside its transaction (frozen) this long is ended

_NAME_BYTES = 63  # Postgres truncates longer identifiers: it would create another name
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()


def available() -> list[Migration]:
    """The migration files shipped in shared/store/migrations, in version order."""
    found = []
    for entry in resources.files("shared.store.migrations").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"two migration files share a version: {versions}")
    return found


def quoted(name: str) -> str:
    """`name` as a quoted SQL identifier (any name Postgres keeps whole: "sked-prod" too)."""
    if not name or "\0" in name or len(name.encode("utf-8")) > _NAME_BYTES:
        raise SkedError(
            f"will not create database {name!r}: a name of 1 to {_NAME_BYTES} bytes, without"
            " NUL, is what Postgres keeps whole; create it yourself or choose another"
        )
    return '"' + name.replace('"', '""') + '"'


async def ensure_database(dsn: str) -> None:
    """Create the target database if it does not exist (first start of a deployment)."""
    try:
        conn = await asyncpg.connect(dsn)
    except asyncpg.InvalidCatalogNameError:
        name = unquote(urlsplit(dsn).path.lstrip("/"))
        statement = f"CREATE DATABASE {quoted(name)}"
        admin = await asyncpg.connect(dsn, database="postgres")
        try:
            await admin.execute(statement)
            log.info("created database %s", name)
        except (asyncpg.DuplicateDatabaseError, asyncpg.UniqueViolationError):
            # another process created it first (two `sked migrate` at once)
            pass
        finally:
            await admin.close()
    else:
        await conn.close()


async def ledger_version(db: asyncpg.Connection | asyncpg.Pool) -> int | None:
    """The newest version in the ledger of this session's schema; None if it has none. Raises
    SkedError if the ledger is in another schema only: sked's tables are there, and a ledger
    made here would start a second, empty set of them (a schema named after the role, first in
    Postgres's default search_path)."""
    row = await db.fetchrow(Q.ledger_schemas.sql)
    assert row is not None
    here, found = row["here"], list(row["found"])
    if here is None:
        raise SkedError(
            "the search_path of sked's sessions names no schema that exists: create it, or"
            " set search_path in the database URL (options=-c search_path=SCHEMA)"
        )
    if here in found:
        version: int = await db.fetchval(Q.schema_version.sql)
        return version
    if found:
        raise SkedError(
            f"sked's migration ledger (schema_migrations) is in schema {', '.join(found)}, not"
            f" in {here}, the schema sked's sessions use: set the schema in the database URL"
            f" (options=-c search_path={found[0]}) rather than build a second, empty set of"
            " tables"
        )
    return None


async def require_migrated(db: asyncpg.Connection | asyncpg.Pool) -> None:
    """Refuse (SkedError) a database whose schema is older than this code's newest migration:
    a service on it would fail every request on a table or function not there yet. A newer
    schema is served: migrations keep the previous release working (a rolling deploy)."""
    have = await ledger_version(db) or 0
    need = available()[-1].version
    if have < need:
        raise SkedError(
            f"database schema at version {have}, this sked needs {need}: run `sked migrate`"
        )


async def migrate(dsn: str) -> int:
    """Apply every migration not yet recorded; return the schema version afterwards."""
    dsn = pinned_dsn(dsn)
    await ensure_database(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(Q.set_idle_timeout.sql, f"{IDLE_TIMEOUT_S * 1000:.0f}ms")
        await conn.execute(Q.lock_migrations.sql)
        try:
            return await _migrate(conn, dsn)
        except _ENDED as exc:
            if not conn.is_closed():
                raise
            raise _lost(exc) from None
        finally:
            if not conn.is_closed():  # a closed one released its lock with its session
                await conn.execute(Q.unlock_migrations.sql)
    finally:
        await conn.close()


async def _migrate(conn: asyncpg.Connection, dsn: str) -> int:
    shipped = available()
    newest = shipped[-1].version
    have = await ledger_version(conn)
    if have is not None and have > newest:
        # nothing redefined: the newer release's functions serve its processes
        raise SkedError(
            f"the database was migrated to version {have} by a newer sked; this one knows"
            f" versions up to {newest} only and changed nothing: run the newer release's"
            " `sked migrate`"
        )
    await conn.execute(Q.create_ledger.sql)
    await conn.execute(Q.add_ledger_checksum.sql)
    done = {row["version"]: row["sha256"] for row in await conn.fetch(Q.applied_checksums.sql)}
    watch = _Watch(dsn, conn.get_server_pid())
    try:
        for migration in shipped:
            if migration.version in done:
                was = done[migration.version]
                if was is not None and was != migration.sha256:
                    log.warning(
                        "migration %s was edited after this database applied it (sha256 %s"
                        " then, %s now): the schema here is the old text's; put a change"
                        " in a new migration",
                        migration.label,
                        was[:12],
                        migration.sha256[:12],
                    )
                continue
            await _apply(conn, watch, migration)
            log.info("applied migration %s", migration.label)
            done[migration.version] = migration.sha256
    finally:
        await watch.close()
    for function in FUNCTIONS:  # after the files: they name the tables' row types
        await conn.execute(Q[function].sql)
    if not await conn.fetchval(Q.autovacuum_on.sql):
        log.warning(AUTOVACUUM_OFF)
    return max(done, default=0)


async def _apply(conn: asyncpg.Connection, watch: _Watch, migration: Migration) -> None:
    """One file in one transaction, tried again while it times out waiting for a lock."""
    loop = asyncio.get_running_loop()
    started, pause = loop.time(), LOCK_RETRY_FIRST_S
    while True:
        try:
            async with watch.watching():
                await _apply_once(conn, migration)
            return
        except asyncpg.LockNotAvailableError:
            waited = loop.time() - started
            holders = watch.holders() or "sessions gone by the time they were looked up"
            if waited + pause > LOCK_RETRY_TOTAL_S:
                raise SkedError(
                    f"migration {migration.label} could not take its locks in"
                    f" {waited:.0f} s, each time waiting on: {holders}; end those"
                    " transactions and run `sked migrate` again"
                ) from None
            log.warning(
                "migration %s gave up a lock after %.0f s (writes queue behind its wait),"
                " held by %s; trying again in %.0f s",
                migration.label,
                LOCK_TIMEOUT_S,
                holders,
                pause,
            )
            await asyncio.sleep(pause * random.uniform(0.75, 1.0))
            pause = min(pause * 2, LOCK_RETRY_MAX_S)


async def _apply_once(conn: asyncpg.Connection, migration: Migration) -> None:
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.execute(Q.set_lock_timeout.sql, f"{LOCK_TIMEOUT_S * 1000:.0f}ms")
        await conn.execute(migration.sql)
        await conn.execute(Q.record_migration.sql, migration.version, migration.name)
        await conn.execute(Q.record_checksum.sql, migration.version, migration.sha256)
    except BaseException as exc:
        if not conn.is_closed():
            await tx.rollback()
        elif isinstance(exc, _ENDED):
            raise _lost(
                exc,
                f"during migration {migration.label}: its transaction was rolled"
                " back, nothing of it applied",
            ) from None
        raise
    try:
        await tx.commit()
    except _ENDED as exc:
        if conn.is_closed():
            raise _lost(
                exc,
                f"at the commit of migration {migration.label} (whether it"
                " committed, schema_migrations says)",
            ) from None
        raise


# What a connection that ended raises: Postgres's FATAL, asyncpg's "connection is closed",
# the socket's error.
_ENDED = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError)


def _lost(exc: BaseException, where: str = "") -> SkedError:
    """The error of a migrator whose connection ended (a terminated backend, a failover): one
    line, in Postgres's words where it gave any (a terminated backend's FATAL comes first,
    asyncpg's "connection was closed" after)."""
    seen: BaseException | None = exc
    why = " ".join(str(exc).split()) or type(exc).__name__
    while seen is not None:
        if isinstance(seen, asyncpg.PostgresError):
            why = str(seen).splitlines()[0]
            break
        seen = seen.__cause__ or seen.__context__
    where = f" {where}" if where else ""
    return SkedError(
        f"the connection to Postgres was lost{where} ({why}): run `sked migrate` again"
    )


class _Watch:
    """Who holds the locks a migration waits for: while a file is applied, a connection of its
    own asks pg_blocking_pids of the migrator's backend (it cannot ask itself: it waits)."""

    def __init__(self, dsn: str, pid: int) -> None:
        self.dsn, self.pid = dsn, pid
        self.conn: asyncpg.Connection | None = None
        self.seen: dict[int, str] = {}

    def watching(self) -> _Watching:
        self.seen = {}
        return _Watching(self)

    def holders(self) -> str:
        return "; ".join(self.seen.values())

    async def poll(self, stop: asyncio.Event) -> None:
        interval = LOCK_TIMEOUT_S / 4
        if await _stopped(stop, interval):
            return  # a statement that waited less is nobody's concern
        try:
            if self.conn is None:
                self.conn = await asyncpg.connect(self.dsn)
            while True:
                for row in await self.conn.fetch(Q.blocking_sessions.sql, self.pid):
                    self.seen[row["pid"]] = _session(row)
                if await _stopped(stop, interval):
                    return
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            log.info("cannot tell who holds the locks migrate waits for: %s", exc)

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()


class _Watching:
    def __init__(self, watch: _Watch) -> None:
        self.watch = watch
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> None:
        self.task = asyncio.create_task(self.watch.poll(self.stop))

    async def __aexit__(self, *_: Any) -> None:
        self.stop.set()  # it ends between two of its queries, never in one
        assert self.task is not None
        await self.task


async def _stopped(stop: asyncio.Event, timeout: float) -> bool:
    try:
        await asyncio.wait_for(stop.wait(), timeout)
    except TimeoutError:
        return False
    return True


def _session(row: asyncpg.Record) -> str:
    who = row["application_name"] or row["usename"] or "?"
    open_s = "" if row["open_s"] is None else f", in a transaction for {row['open_s']} s"
    return f"pid {row['pid']} ({who}, {row['state']}{open_s})"
