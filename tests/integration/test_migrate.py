"""`sked migrate`: concurrent runs, idempotence, and every query prepared against the schema."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import asyncpg

from services.relay import service as relay_service
from shared import migrate as migrate_module
from shared import nodes as nodes_module
from shared import repo as repo_module
from tests.conftest import PG_ADMIN, PG_BASE, RUN

SKED = str(Path(sys.executable).with_name("sked"))


async def test_two_concurrent_migrates_leave_one_version() -> None:
    name = f"{RUN}_migrate_race"
    admin = await asyncpg.connect(PG_ADMIN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()
    env = {**os.environ, "SKED_DATABASE_URL": f"{PG_BASE}/{name}"}
    try:
        procs = [
            await asyncio.create_subprocess_exec(
                SKED,
                "migrate",
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            for _ in range(2)
        ]
        outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 60)
        for proc, (out, _) in zip(procs, outs, strict=True):
            assert proc.returncode == 0, out.decode()
        latest = migrate_module.available()[-1].version
        conn = await asyncpg.connect(f"{PG_BASE}/{name}")
        try:
            rows = await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")
            assert [r["version"] for r in rows] == [m.version for m in migrate_module.available()]
            assert rows[-1]["version"] == latest
            shards = await conn.fetchval("SELECT count(*) FROM outbox_shards")
            assert shards == 16  # the seed rows went in once, not twice
        finally:
            await conn.close()
        # and a third run is a no-op
        assert await migrate_module.migrate(f"{PG_BASE}/{name}") == latest
    finally:
        admin = await asyncpg.connect(PG_ADMIN)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_every_query_prepares(pool: asyncpg.Pool) -> None:
    """A typo in any SQL constant fails here, not in production."""
    queries = {
        f"{module.__name__}.{name}": value
        for module in (repo_module, relay_service, migrate_module, nodes_module)
        for name, value in vars(module).items()
        if name.isupper()
        and isinstance(value, str)
        and value.lstrip().split(" ")[0].upper()
        in {"SELECT", "INSERT", "UPDATE", "WITH", "DELETE", "CREATE"}
    }
    assert len(queries) >= 10
    async with pool.acquire() as conn:
        for where, sql in queries.items():
            try:
                await conn.prepare(sql)
            except asyncpg.PostgresError as exc:  # pragma: no cover - the failure message
                raise AssertionError(f"{where} does not prepare: {exc}") from exc
