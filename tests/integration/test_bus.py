"""The bus against real RabbitMQ: a dispatch no queue is bound for is not taken as sent."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

import aio_pika
import aiormq.exceptions
import pytest

from shared.bus import (
    DEAD_QUEUE,
    DISPATCH_EXCHANGE,
    PROBE_EXCHANGE,
    SUBMIT_KEY,
    SUBMIT_QUEUE,
    TASKS_EXCHANGE,
    UNROUTABLE,
    AmqpBus,
    Outgoing,
)
from shared.client import SkedClient
from shared.resilience import is_transient
from shared.settings import Settings
from tests.helpers import eventually

T = TypeVar("T")


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


async def test_dead_letters_are_read_in_order_and_left_in_place(settings: Settings) -> None:
    """`sked dead` reads sked.dead oldest first without taking anything off it, both what
    intake dead-lettered (its reason) and what RabbitMQ did (a rejected submission)."""
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    try:
        for n in range(3):
            await bus.dead_letter(f"bad {n}".encode(), f"reason {n}", "submit")
        await bus.publish(TASKS_EXCHANGE, [Outgoing(SUBMIT_KEY, b"rejected one")])
        channel = await bus.consumer_channel(prefetch=1)
        submitted = await channel.declare_queue(SUBMIT_QUEUE, passive=True)
        message = await submitted.get(timeout=5)
        await message.reject(requeue=False)  # to sked.dlx, as RabbitMQ dead-letters

        async def peek(limit: int) -> list[tuple[str, str]]:
            return [(d.body, d.reason) for d in await bus.peek_dead(limit)]

        expected = [(f"bad {n}", f"reason {n}") for n in range(3)]
        expected.append(("rejected one", "dead-lettered by RabbitMQ: rejected"))
        await eventually(lambda: _equal(peek(10), expected), timeout=10, what="all four")
        assert await peek(10) == expected  # read again: all still there, in order
        assert await peek(2) == expected[:2]
        async with SkedClient(settings) as client:
            letters = await client.dead_letters(3)
        assert [(d.body, d.routing_key) for d in letters] == [
            (f"bad {n}", "submit") for n in range(3)
        ]
    finally:
        await bus.close()
    assert len(await _dead_bodies(settings.rabbitmq_url)) == 4


async def _equal(value: Awaitable[T], expected: T) -> bool:
    return await value == expected
