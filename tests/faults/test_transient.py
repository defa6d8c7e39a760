"""What an operator or a failover does to connections — cancel every query, terminate every
backend, turn the database read-only for a while — is ridden out by every service: work
stalls, then completes by itself; no service exits, no task is lost or run twice."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg

from shared.client import SkedClient
from shared.fsm import State
from tests.conftest import PG_ADMIN
from tests.e2e.checks import check_all_histories
from tests.faults.checks import duplicated, overlap_s, read_stamps
from tests.faults.conftest import Deployment, Row
from tests.faults.jobs import stamp_specs, start_all
from tests.helpers import eventually

OTHERS = "SELECT {}(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()"
ACTIVE = OTHERS + " AND state = 'active'"


async def test_admin_cancel_terminate_and_a_read_only_spell(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    dsn: str,
    stamps: Path,
    record: list[Row],
) -> None:
    db = urlsplit(dsn).path.lstrip("/")
    procs = await start_all(deployment, ["t1", "t2"], 6)
    ids = await client.submit_many(
        stamp_specs(stamps, 300, 50, heartbeat_timeout_s=10.0, max_retries=3, backoff_base_s=0.1)
    )

    async def some_done() -> bool:
        return bool(await pool.fetchval("SELECT count(*) FROM tasks WHERE status = 'success'"))

    await eventually(some_done, timeout=60, what="work under way")
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        # an operator cancelling every running query, again and again, until some service
        # met a cancel (a cancel that lands between two queries cancels nothing)
        for _ in range(500):
            await admin.execute(ACTIVE.format("pg_cancel_backend"), db)
            if any("QueryCanceledError" in p.log() for p in procs.values()):
                break
            await asyncio.sleep(0.01)
        await admin.execute(OTHERS.format("pg_terminate_backend"), db)  # admin shutdown
        await asyncio.sleep(0.5)
        # a failover onto a standby: every new connection is read-only for a while
        await admin.execute(f'ALTER DATABASE "{db}" SET default_transaction_read_only = on')
        await admin.execute(OTHERS.format("pg_terminate_backend"), db)
        await asyncio.sleep(3.0)
        await admin.execute(f'ALTER DATABASE "{db}" RESET default_transaction_read_only')
        await admin.execute(OTHERS.format("pg_terminate_backend"), db)
    finally:
        await admin.execute(f'ALTER DATABASE "{db}" RESET default_transaction_read_only')
        await admin.close()
    await pool.expire_connections()
    done = await client.wait_all(ids, timeout=180)
    lost = sum(t.status is not State.SUCCESS for t in done.values())
    runs = read_stamps(stamps)
    record.append(
        Row(
            "admin cancel, terminate, read-only spell",
            300,
            lost,
            duplicated(runs),
            None,
            overlap_s(runs),
        )
    )
    assert lost == 0
    assert duplicated(runs) == 0
    await check_all_histories(pool)
    logs = "\n".join(p.log() for p in procs.values())
    for error in ("QueryCanceledError", "ReadOnlySQLTransactionError"):
        assert error in logs, f"no service met {error}: the test did not test it"
    for proc in deployment.procs:
        assert proc.proc.poll() is None, f"{proc.name} exited:\n{proc.log()}"
        assert "service failed" not in proc.log(), proc.log()
