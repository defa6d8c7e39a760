"""RabbitMQ: the topology's names, and publishing with publisher confirms (aio-pika).

Every exchange and queue name sked uses is a constant here, so a reader finds the whole
message flow in one file.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractRobustConnection

from shared.fsm import State

log = logging.getLogger(__name__)

# Transition events, relayed from the outbox. Routing key: task.<state>, e.g. task.retry_wait.
EVENTS_EXCHANGE = "sked.events"
SCHEMA_HEADER = "x-sked-schema"
JSON = "application/json"


def event_routing_key(state: State) -> str:
    return f"task.{state.value}"


@dataclass(frozen=True)
class Outgoing:
    routing_key: str
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)


class AmqpBus:
    """One robust connection and one confirming channel; declares the topology it uses."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}

    async def connect(self) -> None:
        self._connection = await aio_pika.connect_robust(self.url)
        self._channel = await self._connection.channel(publisher_confirms=True)
        self._exchanges[EVENTS_EXCHANGE] = await self._channel.declare_exchange(
            EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
        )

    @property
    def channel(self) -> AbstractChannel:
        if self._channel is None:
            raise RuntimeError("AmqpBus.connect() was not called")
        return self._channel

    async def publish(self, exchange: str, messages: Sequence[Outgoing]) -> None:
        """Publish persistent messages and return once the broker confirmed every one.

        All are in flight at once (a confirm round trip per message would cap throughput at
        about 1,500 messages/s here). Raises if any is refused; the caller then retries all of
        them, which is why consumers must drop duplicates.
        """
        target = self._exchanges[exchange]
        confirms = [
            target.publish(
                aio_pika.Message(
                    m.body,
                    content_type=JSON,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    headers=m.headers,
                ),
                routing_key=m.routing_key,
            )
            for m in messages
        ]
        await asyncio.gather(*confirms)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
            self._channel = None
