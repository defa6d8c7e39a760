"""The bus against real RabbitMQ: a dispatch no queue is bound for is not taken as sent."""

from __future__ import annotations

import logging

import aio_pika
import aiormq.exceptions
import pytest

from shared.bus import (
    DEAD_QUEUE,
    DISPATCH_EXCHANGE,
    PROBE_EXCHANGE,
    UNROUTABLE,
    AmqpBus,
    Outgoing,
)
from shared.resilience import is_transient
from shared.settings import Settings


async def test_a_dispatch_to_a_node_without_a_queue_raises_a_transient_error(
    settings: Settings,
) -> None:
    """RabbitMQ returns a mandatory message no queue is bound for, and then confirms it: the
    publish must raise (the scheduler takes the attempt back to Ready), not return as if the
    dispatch were queued (it would wait for the stuck-in-Scheduling sweep)."""
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    try:
        channel = await bus.consumer_channel(prefetch=1)
        queue = await bus.declare_node_queue(channel, "here")
        await bus.publish(DISPATCH_EXCHANGE, [Outgoing("here", b"{}")])  # routed: fine
        with pytest.raises(aiormq.exceptions.DeliveryError) as raised:
            await bus.publish(
                DISPATCH_EXCHANGE, [Outgoing("here", b"{}"), Outgoing("nowhere", b"{}")]
            )
        assert is_transient(raised.value)
        assert (await queue.get(timeout=5)).body == b"{}"
        # a request nobody is bound for is still told apart from one nobody answered
        assert await bus.request(PROBE_EXCHANGE, "nobody", b"{}", timeout=5) is UNROUTABLE
        # and the channel goes on publishing
        await bus.publish(DISPATCH_EXCHANGE, [Outgoing("here", b"{}")])
    finally:
        await bus.close()


async def _dead_bodies(url: str) -> list[bytes]:
    """What sked.dead holds, oldest first (taken off it)."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(DEAD_QUEUE, passive=True)
        bodies = []
        while (message := await queue.get(fail=False, timeout=5)) is not None:
            bodies.append(message.body)
            await message.ack()
        return bodies
    finally:
        await connection.close()


async def test_the_dead_letter_queue_keeps_the_newest_within_its_bounds(
    settings: Settings,
) -> None:
    """sked.dead is bounded (here at 3 messages): a flood of bad messages drops the oldest,
    and dead-lettering never fails for it (intake would stall)."""
    bus = AmqpBus(settings.rabbitmq_url, (3, 1024 * 1024))
    await bus.connect()
    try:
        for n in range(1, 6):
            await bus.dead_letter(str(n).encode(), "unreadable", "submit")
    finally:
        await bus.close()
    assert await _dead_bodies(settings.rabbitmq_url) == [b"3", b"4", b"5"]


@pytest.mark.parametrize(
    ("made_with", "kept"),
    [
        (None, [b"1", b"2", b"3", b"4", b"5"]),  # as sked declared it until it was bounded
        ({"x-max-length": 2}, [b"4", b"5"]),  # an operator's own bound
    ],
)
async def test_a_dead_letter_queue_made_with_other_bounds_is_kept(
    settings: Settings,
    caplog: pytest.LogCaptureFixture,
    made_with: dict[str, int] | None,
    kept: list[bytes],
) -> None:
    """A sked.dead declared before it was bounded, or with other bounds, cannot be changed by
    a declaration: the bus warns, uses it as it is, and goes on publishing."""
    connection = await aio_pika.connect(settings.rabbitmq_url)
    channel = await connection.channel()
    await channel.declare_queue(DEAD_QUEUE, durable=True, arguments=made_with)
    await connection.close()
    bus = AmqpBus(settings.rabbitmq_url, (3, 1024 * 1024))
    with caplog.at_level(logging.WARNING, logger="shared.bus"):
        await bus.connect()
    try:
        assert "exists with other bounds" in caplog.text
        for n in range(1, 6):
            await bus.dead_letter(str(n).encode(), "unreadable", "submit")
        channel = await bus.consumer_channel(prefetch=1)
        queue = await bus.declare_node_queue(channel, "here")
        await bus.publish(DISPATCH_EXCHANGE, [Outgoing("here", b"{}")])
        assert (await queue.get(timeout=5)).body == b"{}"
    finally:
        await bus.close()
    assert await _dead_bodies(settings.rabbitmq_url) == kept
