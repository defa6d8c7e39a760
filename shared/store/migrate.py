"""Forward-only schema migrations: plain SQL files applied in order and recorded; then the
SQL functions the statements call are defined anew from the statements' own files.

`sked migrate` runs `migrate()`. Several processes may run it at once: a session advisory lock
serialises them, and each file is applied in its own transaction with its version recorded, so a
crash midway leaves the schema at the last whole version.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources
from urllib.parse import unquote, urlsplit

import asyncpg

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

_DB_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


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


async def ensure_database(dsn: str) -> None:
    """Create the target database if it does not exist (first start of a deployment)."""
    try:
        conn = await asyncpg.connect(dsn)
    except asyncpg.InvalidCatalogNameError:
        name = unquote(urlsplit(dsn).path.lstrip("/"))
        if not _DB_NAME.match(name):
            raise ValueError(f"will not create database {name!r}: use [A-Za-z0-9_] only") from None
        admin = await asyncpg.connect(dsn, database="postgres")
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
            log.info("created database %s", name)
        except (asyncpg.DuplicateDatabaseError, asyncpg.UniqueViolationError):
            # another process created it first (two `sked migrate` at once)
            pass
        finally:
            await admin.close()
    else:
        await conn.close()


async def migrate(dsn: str) -> int:
    """Apply every migration not yet recorded; return the schema version afterwards."""
    await ensure_database(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(Q.lock_migrations.sql)
        try:
            await conn.execute(Q.create_ledger.sql)
            done = {row["version"] for row in await conn.fetch(Q.applied_migrations.sql)}
            for migration in available():
                if migration.version in done:
                    continue
                async with conn.transaction():
                    await conn.execute(migration.sql)
                    await conn.execute(Q.record_migration.sql, migration.version, migration.name)
                log.info("applied migration %04d_%s", migration.version, migration.name)
                done.add(migration.version)
            for function in FUNCTIONS:  # after the files: they name the tables' row types
                await conn.execute(Q[function].sql)
            if not await conn.fetchval(Q.autovacuum_on.sql):
                log.warning(AUTOVACUUM_OFF)
            return max(done, default=0)
        finally:
            await conn.execute(Q.unlock_migrations.sql)
    finally:
        await conn.close()
