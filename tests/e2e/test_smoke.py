"""The smallest whole pipeline: submit one command and one handler, both succeed."""

from __future__ import annotations

import asyncpg

from shared.client import SkedClient
from shared.errors import NotFound
from shared.fsm import State
from tests.e2e.conftest import Deployment
from tests.helpers import eventually


async def test_one_command_and_one_handler(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("n1", 2)
    cmd = await client.submit(
        {"name": "echo", "job": {"kind": "command", "argv": ["sh", "-c", "echo hi $SKED_ATTEMPT"]}}
    )
    handler = await client.submit(
        {
            "name": "add",
            "job": {"kind": "handler", "handler": "tests.e2e.jobs:add", "args": {"a": 2, "b": 3}},
        }
    )
    done = await client.wait_all([cmd, handler], timeout=30)
    assert done[cmd].status is State.SUCCESS, done[cmd]
    assert "hi 1" in (done[cmd].log_tail or "")
    assert done[handler].status is State.SUCCESS, done[handler]
    assert done[handler].result == 5
    history = [(e.from_status, e.to_status) for e in await client.history(cmd)]
    assert [t for _, t in history] == [
        State.CREATED,
        State.PENDING,
        State.READY,
        State.SCHEDULING,
        State.RUNNING,
        State.SUCCESS,
    ]
    # each service's sessions are named after it (pg_stat_activity.application_name)
    names = await pool.fetch(
        "SELECT DISTINCT application_name FROM pg_stat_activity WHERE datname = current_database()"
    )
    assert {"sked-scheduler", "sked-relay", "sked-executor"} <= {r[0] for r in names}


async def test_the_log_of_a_running_attempt_is_read_from_its_executor(
    deployment: Deployment, client: SkedClient
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("n1", 1)
    task_id = await client.submit(
        {"name": "talk", "job": {"kind": "command", "argv": ["sh", "-c", "echo started; sleep 60"]}}
    )

    async def live() -> str | None:
        try:
            task = await client.get(task_id)
        except NotFound:
            return None
        return await client.log(task_id) if task.status is State.RUNNING else None

    assert "started" in await eventually(live, what="the running attempt's log")
    await client.cancel(task_id, "seen enough")
    assert (await client.wait(task_id, timeout=30)).status is State.CANCELED
