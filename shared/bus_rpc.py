"""Request/reply over RabbitMQ (the heartbeat-monitor's probes, `sked logs`): one exclusive
reply queue per bus, made on first use, and every request bounded as a whole — making the
reply queue, the publish and its confirm, and the wait for the answer."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage, AbstractQueue
from pamqp.commands import Basic

log = logging.getLogger(__name__)

JSON = "application/json"

# What a request can meet when RabbitMQ is away, cut off or refusing: each means "no answer".
# (ChannelInvalidStateError is a RuntimeError, not an AMQPError: a channel closed under us.)
_NO_ANSWER = (
    TimeoutError,
    OSError,
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
)


class Unroutable:
    """A request no consumer was bound for: RabbitMQ returned it at once (`mandatory`)."""


UNROUTABLE = Unroutable()

# Whether a reply is the one the requester waits for (a signed answer to its request, say):
# one it refuses is dropped, and the wait goes on, so a forger who answers first cannot
# pre-empt the real answer.
Accept = Callable[[bytes], bool]


def returned(sent: object) -> bool:
    """Whether a publish's confirmation is RabbitMQ handing a mandatory message back (no queue
    was bound for it): aiormq resolves it with the returned message, then the broker's ack."""
    return isinstance(getattr(sent, "delivery", None), Basic.Return)


class RequestReply:
    """The request/reply side of one bus, on its confirming channel (`channel`, a getter:
    the channel exists once the bus connected)."""

    def __init__(self, channel: Callable[[], AbstractChannel]) -> None:
        self._channel = channel
        self._replies: AbstractQueue | None = None  # made on first use
        self._making = asyncio.Lock()  # one reply queue, however many first requests at once
        self._waiting: dict[str, tuple[asyncio.Future[bytes], Accept | None]] = {}

    def reset(self) -> None:
        """The connection is gone (closed): the next request makes a reply queue anew."""
        self._replies = None

    async def request(
        self,
        exchange: AbstractExchange,
        routing_key: str,
        body: bytes,
        timeout: float,
        correlation_id: str | None = None,
        accept: Accept | None = None,
    ) -> bytes | Unroutable | None:
        """Publish a request and wait for its answer: the first reply `accept` takes (any
        reply, without it); UNROUTABLE if no consumer is bound for `routing_key`; None if none
        came within `timeout` seconds — counted from the call, whatever held it: a reply queue
        that cannot be made (RabbitMQ down), a publish that is not confirmed (a partition, a
        resource alarm) — or the request could not be sent."""
        correlation = correlation_id or uuid.uuid4().hex
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[correlation] = (answer, accept)
        try:
            async with asyncio.timeout(timeout):
                replies = await self._reply_queue()
                sent = await exchange.publish(
                    aio_pika.Message(
                        body, content_type=JSON, correlation_id=correlation, reply_to=replies.name
                    ),
                    routing_key=routing_key,
                    mandatory=True,
                )
                if returned(sent):
                    return UNROUTABLE
                return await answer
        except _NO_ANSWER as exc:
            log.info(
                "request to %s %s: no answer (%s)", exchange.name, routing_key, type(exc).__name__
            )
            return None
        finally:
            self._waiting.pop(correlation, None)

    async def _reply_queue(self) -> AbstractQueue:
        async with self._making:
            if self._replies is None:
                queue = await self._channel().declare_queue(exclusive=True, auto_delete=True)
                await queue.consume(self._on_reply, no_ack=True)
                self._replies = queue  # only once it is consumed: else made again next time
            return self._replies

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        waiting = self._waiting.get(message.correlation_id or "")
        if waiting is None:
            return  # a late answer, or one to nothing asked
        answer, accept = waiting
        if not answer.done() and (accept is None or accept(message.body)):
            answer.set_result(message.body)
