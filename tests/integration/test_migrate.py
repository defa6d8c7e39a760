"""The schema and the SQL: `sked migrate` under concurrent runs, schema.sql equal to what the
migrations build, every named statement prepared against it, and the state lists written in
SQL equal to the FSM's."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any
from uuid import uuid4

import asyncpg

from shared import fsm
from shared.fsm import State
from shared.models import Event, TaskSpec
from shared.store import Store
from shared.store import migrate as migrate_module
from shared.store.moves import move_args
from shared.store.queries import Q, load
from tests.conftest import PG_ADMIN, PG_BASE, RUN
from tests.helpers import spec

SKED = str(Path(sys.executable).with_name("sked"))


async def test_two_concurrent_migrates_leave_one_version() -> None:
    name = f"{RUN}_migrate_race"
    admin = await asyncpg.connect(PG_ADMIN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    autovacuum = await admin.fetchval("SHOW autovacuum")
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
            # the operator is told when nothing will reclaim the tasks' dead row versions
            assert (migrate_module.AUTOVACUUM_OFF in out.decode()) == (autovacuum == "off")
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


CATALOGUE = {
    "columns": """
        SELECT table_name, column_name, data_type, udt_name, is_nullable, column_default,
               generation_expression, is_identity
        FROM information_schema.columns WHERE table_schema = 'public'
        AND table_name <> 'schema_migrations'
    """,
    "constraints": """
        SELECT conrelid::regclass::text AS tbl, contype, pg_get_constraintdef(oid) AS def
        FROM pg_constraint WHERE connamespace = 'public'::regnamespace
        AND conrelid::regclass::text <> 'schema_migrations'
    """,
    "indexes": """
        SELECT tablename, indexdef FROM pg_indexes WHERE schemaname = 'public'
        AND tablename <> 'schema_migrations'
    """,
}


async def catalogue(dsn: str) -> dict[str, set[tuple[Any, ...]]]:
    conn = await asyncpg.connect(dsn)
    try:
        return {k: {tuple(r) for r in await conn.fetch(sql)} for k, sql in CATALOGUE.items()}
    finally:
        await conn.close()


async def test_schema_sql_is_what_the_migrations_build(dsn: str) -> None:
    """The migrated test database against an empty one given schema.sql: the same tables,
    columns, types, defaults, constraints and indexes."""
    name = f"{RUN}_schema_sql"
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
        conn = await asyncpg.connect(f"{PG_BASE}/{name}")
        try:
            schema = resources.files("shared.store").joinpath("schema.sql").read_text("utf-8")
            await conn.execute(schema)
        finally:
            await conn.close()
        migrated, written = await catalogue(dsn), await catalogue(f"{PG_BASE}/{name}")
        for part in CATALOGUE:
            assert migrated[part] - written[part] == set(), f"{part}: missing in schema.sql"
            assert written[part] - migrated[part] == set(), f"{part}: not in the migrations"
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_every_statement_is_named_described_and_prepares(pool: asyncpg.Pool) -> None:
    """A typo in any SQL statement fails here, not in production."""
    assert len(Q) >= 50
    async with pool.acquire() as conn:
        for query in Q.values():
            assert query.doc, f"{query.name} says nothing of itself"
            assert "{{" not in query.sql, f"{query.name}: a fragment was not expanded"
            if query.name in {"create_ledger", *migrate_module.FUNCTIONS}:
                continue  # DDL does not prepare; migrate runs it
            try:
                await conn.prepare(query.sql)
            except asyncpg.PostgresError as exc:  # pragma: no cover - the failure message
                raise AssertionError(f"{query.name} ({query.source}): {exc}") from exc


async def test_the_cas_plan_made_on_a_young_table_reads_tasks_by_primary_key(
    pool: asyncpg.Pool, store: Store
) -> None:
    """sked_transition keeps one generic plan per session, made at its first call: when that
    comes while the tasks table is small, the plan must still be one that fits a large table
    (found: the status index scanned for a task's id, 130 ms a call at 50,000 rows). Planned
    here as the function plans it (its own settings from pg_proc, generic, on five rows):
    tasks is read by its primary key alone."""
    spec = TaskSpec.parse({"name": "young", "job": {"kind": "handler", "handler": "m:f"}})
    young = await store.tasks.create_many([spec] * 5)
    async with pool.acquire() as conn, conn.transaction():
        config = await conn.fetchval(
            "SELECT proconfig FROM pg_proc WHERE proname = 'sked_transition'"
        )
        for setting in config:
            name, _, value = setting.partition("=")
            await conn.execute(f"SET LOCAL {name} = {value}")
        sql = Q.define_transition.sql
        body = sql[sql.index("RETURN QUERY") + len("RETURN QUERY") : sql.rindex(";\nEND")]
        await conn.execute(
            f"PREPARE cas (uuid[], int[], text[], text[], text[], text[], float8) AS {body}"
        )
        # EXPLAIN EXECUTE takes no bound parameters: the moves go in as quoted literals
        types = ("uuid[]", "int[]", "text[]", "text[]", "text[]", "text[]")
        moves = move_args([fsm.plan(t, fsm.State.PENDING) for t in young])
        literals = [
            await conn.fetchval(f"SELECT quote_literal($1::{kind}) || '::{kind}'", value)
            for kind, value in zip(types, moves, strict=True)
        ]
        explained = await conn.fetch(f"EXPLAIN EXECUTE cas({', '.join(literals)}, 0.5)")
        plan = "\n".join(r[0] for r in explained)
        await conn.execute("DEALLOCATE cas")
    reads = re.findall(r"(\w[\w ]*Scan)(?: using (\w+))? on tasks\b", plan)
    assert reads, plan
    assert all(kind == "Index Scan" and index == "tasks_pkey" for kind, index in reads), plan


async def _plans_of(dsn: str, statement: str) -> list[str]:
    """The plans of every statement `statement` runs, nested ones included (auto_explain), on a
    new connection: a PL/pgSQL function plans its statements anew in each session."""
    conn = await asyncpg.connect(dsn)
    plans: list[str] = []
    conn.add_log_listener(lambda _conn, message: plans.append(message.message))
    try:
        await conn.execute("LOAD 'auto_explain'")
        for setting in ("log_min_duration = 0", "log_nested_statements = on"):
            await conn.execute(f"SET auto_explain.{setting}")
        await conn.execute("SET client_min_messages = log")
        for _ in range(7):  # past the five custom plans a statement may get before a generic one
            await conn.fetch(statement)
        await asyncio.sleep(0.05)  # the log messages are handed to listeners by the loop
    finally:
        await conn.close()
    return plans


async def test_placement_reads_the_usage_by_a_plain_index_scan(dsn: str, store: Store) -> None:
    """sked_nodes reads the nodes' usage through tasks_active_by_node, a partial index every
    attempt enters and leaves. A bitmap scan of it cannot mark the entries of tasks that moved
    on as dead, so each placement visited their heap pages again, more the longer since a
    vacuum (found: 1,053 pages, ~1 ms a placement after 5,500 tasks). Whether the table is
    young or has seen attempts come and go (and been analyzed), every plan the function uses
    reads tasks by a plain index scan of that index (and of tasks_lease_held, for attempts
    running on past a pause or cancel)."""
    for when in ("young", "churned"):
        if when == "churned":
            tasks = await store.tasks.create_many([spec(name="churn")] * 200)
            for target, patch in (
                (State.PENDING, {}),
                (State.READY, {}),
                (State.SCHEDULING, {"node": "n1"}),
                (State.RUNNING, {"lease_owner": str(uuid4())}),
                (State.SUCCESS, {}),
            ):
                tasks = await store.tasks.transition_many(
                    [fsm.plan(t, target, "churn", **patch) for t in tasks]
                )
            assert len(tasks) == 200
            admin = await asyncpg.connect(dsn)
            await admin.execute("ANALYZE tasks")
            await admin.close()
        for lock in ("false", "true"):
            plans = await _plans_of(dsn, f"SELECT * FROM sked_nodes(30, {lock})")
            reads = [
                read
                for plan in plans
                for read in re.findall(r"(\w[\w ]*Scan)(?: using (\w+))? on tasks\b", plan)
            ]
            assert reads, (when, lock, plans)
            # and the few attempts running on past a pause or cancel, by their own index
            assert set(reads) == {
                ("Index Scan", "tasks_active_by_node"),
                ("Index Scan", "tasks_lease_held"),
            }, (when, lock, plans)
            assert not any("JIT" in plan for plan in plans), (when, lock, plans)


def _states(sql_list: str) -> set[str]:
    return set(re.findall(r"'(\w+)'", sql_list))


def test_the_state_lists_in_sql_are_the_fsm_s() -> None:
    fragments = {b.name: b.body for b in _fragments()}
    assert _states(fragments["terminal_states"]) == {s.value for s in fsm.ALWAYS_TERMINAL}
    assert _states(fragments["retryable_states"]) == {s.value for s in fsm.RETRYABLE}
    assert _states(fragments["slot_states"]) == {s.value for s in fsm.HOLDS_SLOT}
    assert _states(fragments["awaits_start_states"]) == {s.value for s in fsm.AWAITS_START}
    assert _states(fragments["taken_away_states"]) == {s.value for s in fsm.TAKES_AWAY}
    # the fields a move may patch are exactly the ones the CAS statement reads from its patch
    read = set(re.findall(r"u\.p (?:\?|->>?) '(\w+)'", Q.define_transition.sql))
    assert read == set(fsm.PATCHABLE)


def _fragments() -> list[Any]:
    from shared.store import queries

    out = []
    for entry in resources.files("shared.store").joinpath("sql").iterdir():
        if entry.name.endswith(".sql"):
            out.extend(b for b in queries._blocks(entry.read_text("utf-8"), entry.name))
    load()
    return [b for b in out if b.kind == "fragment"]


async def test_events_not_yet_relayed_move_to_the_outbox_in_order() -> None:
    """Migration 0016 (the outbox apart from the history): a database migrated to 0015 with
    events published and not is migrated on; those not yet published are in the outbox, in
    their order, each with its event's JSON as the relay sends it; the history keeps all."""
    name = f"{RUN}_outbox_0016"
    admin = await asyncpg.connect(PG_ADMIN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    dsn = f"{PG_BASE}/{name}"
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(Q.create_ledger.sql)
            for m in migrate_module.available():
                if m.version < 16:
                    await conn.execute(m.sql)
                    await conn.execute(Q.record_migration.sql, m.version, m.name)
            a, b = uuid4(), uuid4()
            rows = [  # (task, from, to, version, published)
                (a, None, "created", 1, True),
                (a, "created", "pending", 2, True),
                (b, None, "created", 1, False),
                (a, "pending", "ready", 3, False),
                (b, "created", "pending", 2, False),
            ]
            for task, src, dst, version, published in rows:
                await conn.execute(
                    "INSERT INTO task_events (task_id, from_status, to_status, version, attempt,"
                    " reason, published_at) VALUES ($1, $2, $3, $4, 0, 'why', "
                    "CASE WHEN $5 THEN now() END)",
                    task,
                    src,
                    dst,
                    version,
                    published,
                )
        finally:
            await conn.close()
        assert await migrate_module.migrate(dsn) == migrate_module.available()[-1].version
        conn = await asyncpg.connect(dsn)
        try:
            outbox = await conn.fetch("SELECT task_id, to_status, at, body FROM outbox ORDER BY id")
            assert await conn.fetchval("SELECT count(*) FROM task_events") == 5
        finally:
            await conn.close()
        events = [Event.model_validate_json(r["body"]) for r in outbox]
        assert [(e.task_id, e.version) for e in events] == [(b, 1), (a, 3), (b, 2)]
        assert [(r["task_id"], r["to_status"]) for r in outbox] == [
            (e.task_id, e.to_status.value) for e in events
        ]
        assert all(r["at"] == e.at for r, e in zip(outbox, events, strict=True))
        assert events[1].from_status is fsm.State.PENDING
        assert events[1].reason == "why"
    finally:
        admin = await asyncpg.connect(PG_ADMIN)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_a_late_result_recorded_twice_is_kept_once() -> None:
    """Migration 0021 (one late result an attempt): a database migrated to 0020 whose
    late_results hold an attempt twice (a finish write retried after its COMMIT went
    through) is migrated on; the first of the copies is kept, and recording it again adds
    nothing."""
    name = f"{RUN}_late_0021"
    admin = await asyncpg.connect(PG_ADMIN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    dsn = f"{PG_BASE}/{name}"
    task = uuid4()
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(Q.create_ledger.sql)
            for m in migrate_module.available():
                if m.version < 21:
                    await conn.execute(m.sql)
                    await conn.execute(Q.record_migration.sql, m.version, m.name)
            await conn.execute(
                "INSERT INTO tasks (id, name, kind, spec, status, heartbeat_timeout_s)"
                " VALUES ($1, 'late', 'handler', '{}', 'canceled', 30)",
                task,
            )
            for attempt, note in [(1, "first"), (1, "again"), (2, "other"), (1, "third")]:
                await conn.execute(
                    "INSERT INTO late_results (task_id, attempt, ok, note)"
                    " VALUES ($1, $2, true, $3)",
                    task,
                    attempt,
                    note,
                )
        finally:
            await conn.close()
        assert await migrate_module.migrate(dsn) == migrate_module.available()[-1].version
        store = await Store.connect(dsn)
        try:
            await store.late.record([(task, 1, False, None, "late", "once more")])
            rows = await store.pool.fetch(
                "SELECT attempt, note FROM late_results WHERE task_id = $1 ORDER BY attempt", task
            )
        finally:
            await store.close()
        assert [(r["attempt"], r["note"]) for r in rows] == [(1, "first"), (2, "other")]
    finally:
        admin = await asyncpg.connect(PG_ADMIN)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
