"""Forward-only schema migrations: plain SQL files applied in order and recorded.

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

log = logging.getLogger(__name__)

# Any constant will do as long as nothing else in the database uses it for an advisory lock.
MIGRATION_LOCK_KEY = 0x5CED_0001

_DB_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""
APPLIED = "SELECT version FROM schema_migrations"
RECORD = "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    """The migration files shipped in shared/migrations, in version order."""
    found = []
    for entry in resources.files("shared.migrations").iterdir():
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
        await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        try:
            await conn.execute(CREATE_LEDGER)
            done = {row["version"] for row in await conn.fetch(APPLIED)}
            for migration in available():
                if migration.version in done:
                    continue
                async with conn.transaction():
                    await conn.execute(migration.sql)
                    await conn.execute(RECORD, migration.version, migration.name)
                log.info("applied migration %04d_%s", migration.version, migration.name)
                done.add(migration.version)
            return max(done, default=0)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    finally:
        await conn.close()
