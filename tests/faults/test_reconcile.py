"""Heartbeats lost in transit while processes finish: each task ends with its real outcome,
never Lost, never retried."""

from __future__ import annotations

import aio_pika
import asyncpg

from shared.bus import HEARTBEATS_EXCHANGE, HEARTBEATS_QUEUE
from shared.client import SkedClient
from shared.fsm import State
from shared.repo import PgTaskRepo
from shared.settings import Settings
from tests.e2e.checks import check_all_histories
from tests.faults.conftest import Deployment, Row
from tests.faults.jobs import FAST
from tests.helpers import eventually


async def test_processes_that_finish_while_heartbeats_are_lost_keep_their_real_outcome(
    deployment: Deployment,
    client: SkedClient,
    settings: Settings,
    pool: asyncpg.Pool,
    repo: PgTaskRepo,
    record: list[Row],
) -> None:
    for name in ("scheduler", "relay", "recovery"):
        await deployment.start(name, env=FAST)
    monitor = await deployment.start("heartbeat-monitor", "--port", "0", env=FAST)
    await deployment.executor("cut", 2, env=FAST)
    common = {"heartbeat_timeout_s": 1.0, "max_retries": 0}
    fails = await client.submit(
        {
            "name": "fails",
            "job": {"kind": "command", "argv": ["sh", "-c", "sleep 3; exit 3"]},
            **common,
        }
    )
    works = await client.submit(
        {"name": "works", "job": {"kind": "command", "argv": ["sh", "-c", "sleep 3"]}, **common}
    )

    async def both_beating() -> bool:
        tasks = await repo.get_many([fails, works])
        return len(tasks) == 2 and all(t.status is State.RUNNING and t.hb_seq > 0 for t in tasks)

    await eventually(both_beating, timeout=30, what="both tasks running and beating")
    connection = await aio_pika.connect(settings.rabbitmq_url)
    try:
        channel = await connection.channel()
        beats = await channel.get_queue(HEARTBEATS_QUEUE)
        await beats.unbind(HEARTBEATS_EXCHANGE)  # every heartbeat from here on is lost
        done = await client.wait_all([fails, works], timeout=30)
        await beats.bind(HEARTBEATS_EXCHANGE)
    finally:
        await connection.close()

    assert (done[fails].status, done[fails].attempt, done[fails].error) == (
        State.FAILED,
        1,
        "exit code 3",
    )
    assert (done[works].status, done[works].attempt) == (State.SUCCESS, 1)
    for task_id in (fails, works):
        states = [e.to_status for e in await repo.history(task_id)]
        assert State.LOST not in states
        assert State.RETRY_WAIT not in states
    # the ladder did act while the beats were cut: it restored, it did not declare a loss
    assert "heartbeat restored" in monitor.log()
    assert "-> Lost" not in monitor.log()
    await check_all_histories(pool)
    record.append(Row("heartbeats cut while processes finish (real outcome)", 2, 0, 0, None))
