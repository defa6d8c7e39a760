"""Processes that finish while their executor is cut off from Postgres (RabbitMQ still up):
the executor cannot write the outcome nor renew the lease, the heartbeat-monitor finds the
lease lapsed, asks the executor over RabbitMQ, and records the real outcome — never Lost,
never retried."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from shared.client import SkedClient
from shared.fsm import State
from shared.store import Store
from tests.e2e.checks import check_all_histories
from tests.faults.conftest import Deployment, Row
from tests.faults.jobs import FAST
from tests.faults.proxy import Proxy
from tests.helpers import eventually


async def test_processes_that_finish_while_their_executor_is_cut_off_keep_their_real_outcome(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    store: Store,
    record: list[Row],
    service_env: dict[str, str],
    tmp_path: Path,
) -> None:
    for name in ("scheduler", "relay", "recovery"):
        await deployment.start(name, env=FAST)
    monitor = await deployment.start("heartbeat-monitor", "--port", "0", env=FAST)
    pg = await Proxy(5432).start()
    try:
        db = pg.url(service_env["SKED_DATABASE_URL"])
        await deployment.executor("cut", 2, env={**FAST, "SKED_DATABASE_URL": db})
        go = tmp_path / "go"
        wait_then = f"while [ ! -e {go} ]; do sleep 0.05; done; sleep 0.3"
        common = {"heartbeat_timeout_s": 2.0, "max_retries": 0}
        fails = await client.submit(
            {
                "name": "fails",
                "job": {"kind": "command", "argv": ["sh", "-c", f"{wait_then}; exit 3"]},
                **common,
            }
        )
        works = await client.submit(
            {"name": "works", "job": {"kind": "command", "argv": ["sh", "-c", wait_then]}, **common}
        )

        async def both_running() -> bool:
            tasks = await store.tasks.get_many([fails, works])
            return len(tasks) == 2 and all(t.status is State.RUNNING for t in tasks)

        await eventually(both_running, timeout=30, what="both tasks running")
        pg.cut()  # from here the executor can neither renew nor write an outcome
        go.touch()  # ... and both processes end well within their lease
        done = await client.wait_all([fails, works], timeout=30)
        pg.heal()
    finally:
        await pg.close()

    assert (done[fails].status, done[fails].attempt, done[fails].error) == (
        State.FAILED,
        1,
        "exit code 3",
    )
    assert (done[works].status, done[works].attempt) == (State.SUCCESS, 1)
    for task_id in (fails, works):
        states = [e.to_status for e in await store.tasks.history(task_id)]
        assert State.LOST not in states
        assert State.RETRY_WAIT not in states
    assert "reconciled to its outcome" in monitor.log()
    assert "-> Lost" not in monitor.log()
    await check_all_histories(pool)
    record.append(Row("executor cut off from Postgres while processes finish", 2, 0, 0, None, 0.0))
