"""The bus against real RabbitMQ: a dispatch no queue is bound for is not taken as sent."""

from __future__ import annotations

import aiormq.exceptions
import pytest

from shared.bus import DISPATCH_EXCHANGE, PROBE_EXCHANGE, UNROUTABLE, AmqpBus, Outgoing
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
