"""Heartbeats over RabbitMQ prove themselves: each beat carries its attempt's token.

Before, anyone who could publish to `sked.heartbeats` could push the deadline of any Running
attempt for good: a task whose executor died was then never judged, never Lost, never retried —
left Running for ever. A forged beat is now refused alone, counted and logged, and a message's
signed beats are still taken; a beat with no token at all makes the message unreadable, which is
dead-lettered with the reason."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from uuid import uuid4

import aio_pika
import pytest

from services.heartbeat_monitor.service import HeartbeatMonitor
from shared import fsm, heartbeat
from shared.bus import DEAD_QUEUE, HEARTBEATS_EXCHANGE, REASON_HEADER, AmqpBus
from shared.fsm import State
from shared.models import Task
from shared.settings import Settings
from shared.store import Store
from tests.helpers import eventually, spec


async def running(store: Store) -> Task:
    task = await store.tasks.create(spec(heartbeat_timeout_s=300))
    for target in (State.PENDING, State.READY, State.SCHEDULING):
        task = await fsm.apply(store.tasks, task, target)
    return await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(uuid4()))


@pytest.fixture
async def monitor(settings: Settings, store: Store) -> AsyncIterator[HeartbeatMonitor]:
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    quick = settings.model_copy(update={"monitor_port": 0, "heartbeat_flush_s": 0.05})
    service = HeartbeatMonitor(quick, store, bus)
    try:
        async with service:
            await asyncio.wait_for(service.ready.wait(), 10)
            yield service
    finally:
        await bus.close()


async def publish(settings: Settings, body: bytes) -> None:
    connection = await aio_pika.connect(settings.rabbitmq_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(HEARTBEATS_EXCHANGE)
        await exchange.publish(aio_pika.Message(body), routing_key="")


async def test_a_forged_beat_over_the_bus_is_refused_and_a_signed_one_taken(
    monitor: HeartbeatMonitor, store: Store, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    forged_for, signed_for = await running(store), await running(store)
    secret = settings.heartbeat_secret
    node = heartbeat.NodeBeat(id="sidecar", boot_id=uuid4(), load=0.0)
    beats = [
        *(
            heartbeat.SignedBeat(task_id=forged_for.id, attempt=1, seq=10**12, token=token)
            for token in (
                "0" * 64,
                heartbeat.token(secret, forged_for.id, 2),  # another attempt's
                heartbeat.token(secret, signed_for.id, 1),  # another task's
                heartbeat.token("another-secret-of-16+", forged_for.id, 1),
            )
        ),
        heartbeat.SignedBeat(
            task_id=signed_for.id, attempt=1, seq=7, token=heartbeat.token(secret, signed_for.id, 1)
        ),
    ]
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # the same forgery thrice: counted thrice, logged once
            message = heartbeat.BeatMessage(node=node, beats=beats)
            await publish(settings, message.model_dump_json().encode())

        async def applied() -> bool:
            return (await store.tasks.get(signed_for.id)).hb_seq == 7

        await eventually(applied, timeout=10, what="the signed beat applied")

        async def all_refused() -> bool:
            return monitor.beats.stats["refused"] == 12

        await eventually(all_refused, timeout=10, what="12 forged beats refused")
    assert (await store.tasks.get(forged_for.id)).hb_seq == forged_for.hb_seq
    assert (await store.tasks.get(forged_for.id)).hb_deadline == forged_for.hb_deadline
    lines = [r.getMessage() for r in caplog.records if "bad token" in r.getMessage()]
    assert lines == ["4 heartbeat(s) over RabbitMQ from node 'sidecar' refused: bad token"]


async def test_a_beat_without_a_token_is_dead_lettered(
    monitor: HeartbeatMonitor, store: Store, settings: Settings
) -> None:
    task = await running(store)
    unsigned = {"task_id": str(task.id), "attempt": 1, "seq": 5}
    node = {"id": "n", "boot_id": str(uuid4()), "load": 0}
    body = json.dumps({"node": node, "beats": [unsigned]}).encode()
    await publish(settings, body)
    connection = await aio_pika.connect(settings.rabbitmq_url)
    async with connection:
        channel = await connection.channel()
        dead = await channel.get_queue(DEAD_QUEUE)

        async def dead_lettered() -> aio_pika.abc.AbstractIncomingMessage | None:
            return await dead.get(fail=False, no_ack=True)

        message = await eventually(dead_lettered, timeout=10, what="the message dead-lettered")
    assert message is not None
    assert message.body == body
    reason = str(message.headers.get(REASON_HEADER, ""))
    assert reason.startswith("unreadable heartbeat message"), reason
    assert "token" in reason, reason
    assert (await store.tasks.get(task.id)).hb_seq == task.hb_seq
    assert monitor.beats.stats["refused"] == 1
