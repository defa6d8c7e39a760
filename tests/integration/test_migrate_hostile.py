"""`sked migrate`, and how the store and the services start against a database, under hostile
conditions: a migration waiting on a lock, a migrator's connection killed half way or its process
frozen, a database newer than the code, a database that is not there or never migrated, a schema
named after the role, a migration edited after it was applied. The cases were found by an
adversarial review; each docstring says what the code did then."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from shared.errors import SkedError
from shared.store import Store
from shared.store import migrate as migrate_module
from shared.store.db import create_pool
from tests.conftest import PG_ADMIN, PG_BASE, RUN
from tests.helpers import spec

SKED = str(Path(sys.executable).with_name("sked"))
LATEST = migrate_module.available()[-1].version


async def _sked(env: dict[str, str], *args: str, timeout: float = 30) -> tuple[int, str]:
    """Run the CLI; its exit code and its output (stdout and stderr together)."""
    proc = await asyncio.create_subprocess_exec(
        SKED, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        return -9, out.decode() + "\n<killed: timed out>"
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def _unapply_0019(dsn: str) -> None:
    """Take migration 0019 (one index on tasks) back out of a migrated database, as if the
    release that ships it had not been deployed yet: the next migrate applies it again."""
    assert {m.version: m.name for m in migrate_module.available()}[19] == "lease_holders"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("DROP INDEX tasks_lease_held")
        await conn.execute("DELETE FROM schema_migrations WHERE version = 19")
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def _writer_holding_tasks(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A transaction that wrote to tasks and is still open (an operator's psql session, a long
    batch): it holds ROW EXCLUSIVE on tasks until it ends."""
    conn = await asyncpg.connect(dsn)
    tx = conn.transaction()
    await tx.start()
    await conn.execute("UPDATE tasks SET priority = priority WHERE false")
    try:
        yield conn
    finally:
        with contextlib.suppress(Exception):
            await tx.rollback()
        await conn.close()


async def _wait_for_lock_wait(dsn: str, like: str, timeout: float = 15) -> int:
    """The pid of the backend of this database whose statement matches `like` once it waits
    on a lock."""
    name = dsn.rsplit("/", 1)[1]
    conn = await asyncpg.connect(PG_ADMIN)
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            pid = await conn.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND query LIKE $2"
                " AND wait_event_type = 'Lock'",
                name,
                like,
            )
            if pid is not None:
                return int(pid)
            await asyncio.sleep(0.05)
        raise AssertionError(f"no backend waited on a lock running {like!r}")
    finally:
        await conn.close()


async def _ledger(dsn: str) -> list[int]:
    conn = await asyncpg.connect(dsn)
    try:
        return [r[0] for r in await conn.fetch("SELECT version FROM schema_migrations ORDER BY 1")]
    finally:
        await conn.close()


# -- 1. a migration queued behind a lock stops every write to tasks ---------------------------


async def test_a_migration_waiting_on_a_lock_does_not_stop_every_task_write(dsn: str) -> None:
    """An upgrade (a database without 0019, migrated) while one transaction that wrote to tasks
    stays open. Migration 0019's CREATE INDEX on tasks waited for that transaction's lock, with
    no lock_timeout and no statement_timeout, for as long as it lasted; and while it waited, its
    queued SHARE lock made every later write to tasks wait behind it: admitting a task, every
    CAS of every scheduler and executor. One idle session stopped the whole cluster for as long
    as it stayed open. A migrator gives up its lock wait quickly (lock_timeout) and tries
    again, so that the services' writes go on meanwhile."""
    await _unapply_0019(dsn)
    store = Store(await create_pool(dsn, size=2), dsn)
    migrating: asyncio.Task[int] | None = None
    try:
        async with _writer_holding_tasks(dsn):
            # the control: the open transaction alone holds up no write
            await asyncio.wait_for(store.tasks.create_many([spec("before")]), 5)
            migrating = asyncio.create_task(migrate_module.migrate(dsn))
            await _wait_for_lock_wait(dsn, "%CREATE INDEX tasks_lease_held%")
            try:
                created = await asyncio.wait_for(store.tasks.create_many([spec("during")]), 10)
            except TimeoutError:
                pytest.fail(
                    "admitting a task waited 10 s (and would wait on) behind the migration's"
                    " CREATE INDEX queued for a lock an idle transaction holds"
                )
            assert len(created) == 1
    finally:
        if migrating is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(migrating, 30)
        await store.close()


# -- 2. a migrator whose connection is killed half way ----------------------------------------


async def test_a_migrate_whose_connection_is_killed_says_why(
    dsn: str, service_env: dict[str, str]
) -> None:
    """`sked migrate` whose session Postgres ends in the middle of a migration (an admin's
    pg_terminate_backend, a failover). The file's transaction rolled back, which is right; but
    migrate's `finally` then ran pg_advisory_unlock on the dead connection, and that error
    (asyncpg InterfaceError "connection is closed") replaced Postgres's own: the operator got
    a 40-line traceback ending in "InterfaceError: connection is closed" (asyncpg's own
    ConnectionDoesNotExistError, then Transaction.__aexit__'s InterfaceError, then the
    unlock's), which the CLI did not recognise as Postgres's (it is no PostgresError), instead
    of one line saying the connection was lost during migration 0019 and nothing of it
    applied."""
    await _unapply_0019(dsn)
    before = await _ledger(dsn)
    shipped = [m.version for m in migrate_module.available()]
    assert before == [v for v in shipped if v != 19], "the ledger is not every version but 0019"
    env = {**service_env, "SKED_DATABASE_URL": dsn}
    async with _writer_holding_tasks(dsn):
        running = asyncio.create_task(_sked(env, "migrate"))
        pid = await _wait_for_lock_wait(dsn, "%CREATE INDEX tasks_lease_held%")
        admin = await asyncpg.connect(PG_ADMIN)
        try:
            assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
        finally:
            await admin.close()
        code, out = await running
    # what held: the half-done migration left nothing behind, neither its ledger row nor
    # the index it was building; and the ledger is as it was, every other version kept
    assert await _ledger(dsn) == before
    check = await asyncpg.connect(dsn)
    try:
        index = await check.fetchval("SELECT to_regclass('tasks_lease_held')")
    finally:
        await check.close()
    assert index is None
    assert code == 2, out
    assert "Traceback" not in out, out
    assert "administrator command" in out, out
    assert "0019_lease_holders" in out, out
    assert "sked migrate" in out, out


# -- 3. a database newer than the code (a rolled back deploy) ---------------------------------


async def test_migrate_of_older_code_does_not_claim_or_rewrite_a_newer_schema(
    dsn: str, service_env: dict[str, str]
) -> None:
    """A deploy rolled back after the next release migrated: the ledger holds a version
    this code has no file for, and the newer release's SQL functions. The older
    `sked migrate` (the compose service, the Kubernetes Job, run again on rollback) exits 0
    saying "schema at version N+1" — a version it knows nothing of — and redefined
    sked_transition, sked_nodes and sked_admit from its own older text under the newer
    release's processes (migrate.py: `return max(done)`, and FUNCTIONS redefined on every
    run with no check). It refuses, naming both versions, and touches nothing."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO schema_migrations (version, name) VALUES ($1, 'from_the_next_release')",
            LATEST + 1,
        )
        # the next release's sked_nodes: same signature, its own body (marked)
        src = await conn.fetchval("SELECT prosrc FROM pg_proc WHERE proname = 'sked_nodes'")
        await conn.execute(
            "UPDATE pg_proc SET prosrc = $1 WHERE proname = 'sked_nodes'",
            src + "\n-- next release\n",
        )
    finally:
        await conn.close()
    code, out = await _sked({**service_env, "SKED_DATABASE_URL": dsn}, "migrate")
    conn = await asyncpg.connect(dsn)
    try:
        src_after = await conn.fetchval("SELECT prosrc FROM pg_proc WHERE proname = 'sked_nodes'")
    finally:
        await conn.close()
    assert src_after.endswith("-- next release\n"), (
        f"the newer release's sked_nodes was replaced by this code's; migrate said: {out}"
    )
    assert f"schema at version {LATEST + 1}" not in out, out
    assert code == 2, out
    assert f"version {LATEST + 1}" in out, out
    assert f"up to {LATEST}" in out, out


# -- 4. databases that are not there, or never migrated ---------------------------------------


@pytest.mark.parametrize("suffix", ["-probe-hyphen", "_" + "x" * 60])
async def test_migrate_of_a_database_name_with_a_hyphen_or_too_long(
    suffix: str, service_env: dict[str, str]
) -> None:
    """`sked migrate` with SKED_DATABASE_URL naming a database that does not exist yet: one
    whose name holds a '-' (sked-prod: a common name, and a valid one quoted), and one longer
    than the 63 bytes Postgres keeps of a name. ensure_database refused both with a
    ValueError, which the CLI did not catch as a SkedError: the operator got a Python
    traceback (services/cli/__init__.py main, `except Exception`). The hyphen is now quoted
    and the database created; the long name, which Postgres would truncate into another
    database, is refused in one line."""
    name = f"{RUN}{suffix}"
    env = {**service_env, "SKED_DATABASE_URL": f"{PG_BASE}/{name}"}
    try:
        code, out = await _sked(env, "migrate")
    finally:
        admin = await asyncpg.connect(PG_ADMIN)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name[:63]}" WITH (FORCE)')
        await admin.close()
    assert "Traceback" not in out, out
    if len(name) <= 63:
        assert code == 0, out
        assert f"schema at version {LATEST}" in out, out
    else:
        assert code == 2, out
        assert out.startswith("sked: will not create database"), out


@pytest.mark.parametrize("case", ["missing", "empty"])
async def test_a_service_on_a_database_not_there_or_not_migrated_says_so(
    case: str, service_env: dict[str, str]
) -> None:
    """A service started before `sked migrate` ran (compose and Kubernetes start them
    together): against a database that does not exist, or one that exists but is empty. It
    exited 1 — fine, its supervisor restarts it — but said so with a traceback through asyncpg
    and wiring ("service failed", shared/runtime.py run_main's log.exception), where the CLI
    says the same in one line with the hint "is the database migrated? `sked migrate` creates
    its tables" (shared/errors.py postgres_refused). The one hint that mattered here was never
    logged."""
    name = f"{RUN}_probe_{case}"
    admin = await asyncpg.connect(PG_ADMIN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    if case == "empty":
        await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    env = {**service_env, "SKED_DATABASE_URL": f"{PG_BASE}/{name}"}
    try:
        code, out = await _sked(env, "service", "relay", timeout=30)
    finally:
        admin = await asyncpg.connect(PG_ADMIN)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    assert code == 1, out
    assert "Traceback" not in out, out
    assert "sked migrate" in out, out


# -- 5. search_path: a schema named after the role -------------------------------------------


async def test_a_schema_named_after_the_role_does_not_hide_every_task(
    dsn: str, store: Store
) -> None:
    """A deployment's database gains a schema named after sked's role — `CREATE SCHEMA
    AUTHORIZATION sked`, the per-user schema Postgres's own "secure schema usage pattern"
    recommends — and `sked migrate` runs again (every deploy runs it). With the default
    search_path ("$user", public) that schema came first: create_ledger's `CREATE TABLE
    IF NOT EXISTS schema_migrations` looked only there, made an empty ledger, and every
    migration was applied again into it, building a second, empty set of tables. From then on
    every unqualified statement of every service resolved to the empty tables: the tasks
    accepted so far were no longer seen (never driven to an end) and new ones went elsewhere.
    Nothing in shared/store/migrate.py or shared/store/db.py pinned the schema (search_path).
    Now every session works in public, so migrate finds its ledger and has nothing to do."""
    [task] = await store.tasks.create_many([spec("before the deploy")])
    role = dsn.split("://", 1)[1].split("@", 1)[0].split(":", 1)[0]
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'CREATE SCHEMA "{role}"')
        # what the bug left behind where it ran: an empty tasks table in the role's schema
        await conn.execute(f'CREATE TABLE "{role}".tasks (LIKE public.tasks INCLUDING ALL)')
    finally:
        await conn.close()
    assert await asyncio.wait_for(migrate_module.migrate(dsn), 60) == LATEST
    after = await Store.connect(dsn, 2)
    try:
        found = await after.tasks.get(task.id)
    finally:
        await after.close()
    assert found.id == task.id
    assert await _ledger_schemas(dsn) == "public"


async def test_migrate_refuses_a_ledger_in_another_schema(dsn: str) -> None:
    """A database whose sked tables (and ledger) are in another schema than the one sked's
    sessions use (they were built under a role's own search_path, say). migrate created a
    new, empty ledger in the session's schema and applied every migration again there: a
    second set of tables the services would then use. It refuses, naming the schema the
    ledger is in, and builds nothing."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE SCHEMA elsewhere")
        await conn.execute("ALTER TABLE schema_migrations SET SCHEMA elsewhere")
    finally:
        await conn.close()
    with pytest.raises(SkedError, match="search_path=elsewhere"):
        await asyncio.wait_for(migrate_module.migrate(dsn), 60)
    assert await _ledger_schemas(dsn) == "elsewhere"


async def _ledger_schemas(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        found: str = await conn.fetchval(
            "SELECT string_agg(table_schema, ',' ORDER BY table_schema)"
            " FROM information_schema.tables WHERE table_name = 'schema_migrations'"
        )
        return found
    finally:
        await conn.close()


# -- 6. a migrator frozen inside its transaction --------------------------------------------


async def test_a_frozen_migrator_does_not_hold_the_tasks_table_indefinitely(
    dsn: str, store: Store, service_env: dict[str, str]
) -> None:
    """`sked migrate` frozen (a VM paused, a pod partitioned from Postgres, SIGSTOP) after its
    migration's statement ran and before its COMMIT: its backend sits "idle in transaction"
    holding what migration 0019 took (SHARE on tasks: every write to tasks waits), and
    Postgres ended it only when TCP keepalive noticed, two hours by default. migrate set no
    idle_in_transaction_session_timeout (nor lock_timeout) on its session
    (shared/store/migrate.py), so one frozen migrator stopped every service's CAS for as long
    as it was frozen."""
    await _unapply_0019(dsn)
    env = {**service_env, "SKED_DATABASE_URL": dsn}
    proc = await asyncio.create_subprocess_exec(
        SKED,
        "migrate",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with _writer_holding_tasks(dsn) as holder:
            pid = await _wait_for_lock_wait(dsn, "%CREATE INDEX tasks_lease_held%")
            os.kill(proc.pid, signal.SIGSTOP)  # frozen: it will send nothing more
            await holder.execute("ROLLBACK")  # its CREATE INDEX now runs to its end
        admin = await asyncpg.connect(PG_ADMIN)
        try:
            for _ in range(200):
                state = await admin.fetchval(
                    "SELECT state FROM pg_stat_activity WHERE pid = $1", pid
                )
                if state == "idle in transaction":
                    break
                await asyncio.sleep(0.05)
            assert state == "idle in transaction", state
        finally:
            await admin.close()
        try:
            await asyncio.wait_for(store.tasks.create_many([spec("while frozen")]), 30)
        except TimeoutError:
            pytest.fail(
                "admitting a task waited 30 s (and waits on) behind a frozen migrator's"
                " open transaction"
            )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()


# -- 7. a migration file edited after it was applied ------------------------------------------


async def test_a_migration_edited_after_it_was_applied_is_noticed(
    dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A shipped migration changed after databases applied it (a fix to 0019's index made in
    place rather than in a 0020): databases migrated before keep the old definition, new ones
    get the new, and `sked migrate` said nothing — schema_migrations recorded a version and a
    name, no checksum of the text applied (sql/migrate.sql create_ledger), so the drift was
    invisible until a plan or a constraint differed in production. It now warns (and applies
    nothing). The file is 'edited' here by handing migrate the changed text, as a new
    release's package would."""
    shipped = migrate_module.available()
    edited = [
        m
        if m.version != 19
        else migrate_module.Migration(
            19, m.name, m.sql.replace("(node, lease_until)", "(node, lease_until, id)")
        )
        for m in shipped
    ]
    assert edited != shipped
    monkeypatch.setattr(migrate_module, "available", lambda: edited)
    caplog.set_level(logging.INFO, logger=migrate_module.__name__)
    version = await asyncio.wait_for(migrate_module.migrate(dsn), 60)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("0019" in line for line in said), (
        f"migrate returned {version}, warned only {said}: the edited 0019 went unnoticed"
    )


async def test_an_api_on_an_unmigrated_database_is_not_ready(service_env: dict[str, str]) -> None:
    """The API started against a database that exists but was never migrated (its Deployment
    started beside the migrate Job). It announced itself, and /healthz — its Kubernetes
    readiness and liveness probe, "answers once the API is connected to its backends"
    (deploy/kubernetes/api.yaml) — said {"ok": true}, so traffic was routed to it; yet every
    authenticated request answered 500 "internal error (logged by the API)", the token check
    failing on api_tokens that was not there (services/api/ops.py `errors`: UndefinedTable is
    neither SkedError nor transient). Nothing at start checked the schema
    (services/api/service.py setup; shared/wiring.py connect_store). Now it refuses to start,
    saying which version it found and needs."""
    import aiohttp

    name = f"{RUN}_probe_api_empty"
    admin = await asyncpg.connect(PG_ADMIN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    env = {**service_env, "SKED_DATABASE_URL": f"{PG_BASE}/{name}"}
    proc = await asyncio.create_subprocess_exec(
        SKED,
        "service",
        "api",
        "--port",
        "0",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        port = None
        while port is None:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            if not line:
                break  # it exited: refusing to start is a fine answer
            seen.append(line)
            if "api listening on http://" in line:
                port = int(line.split("http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        if port is None:
            said = "".join(seen)
            assert f"database schema at version 0, this sked needs {LATEST}" in said, said
            assert "Traceback" not in said, said
            return
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{port}"
            async with http.get(f"{base}/healthz") as r:
                health = (r.status, await r.text())
            headers = {"Authorization": "Bearer some-token"}
            async with http.get(f"{base}/v1/nodes", headers=headers) as r:
                nodes = (r.status, await r.text())
        assert health[0] != 200 or nodes[0] != 500, (
            f"/healthz answered {health} while /v1/nodes answered {nodes}"
        )
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        admin = await asyncpg.connect(PG_ADMIN)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
