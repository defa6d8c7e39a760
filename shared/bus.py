"""RabbitMQ: the topology's names, and publishing with publisher confirms (aio-pika).

Every exchange and queue name sked uses is a constant here, so a reader finds the whole
message flow in one file.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq.exceptions
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)

from shared.bus_rpc import UNROUTABLE as UNROUTABLE
from shared.bus_rpc import Accept, RequestReply, Unroutable
from shared.bus_rpc import returned as _returned
from shared.dead_letters import REASON_HEADER as REASON_HEADER
from shared.dead_letters import DeadLetter, dead_letter_of
from shared.errors import AmqpAway
from shared.fsm import State

log = logging.getLogger(__name__)

# Transition events, relayed from the outbox. Routing key: task.<state>, e.g. task.retry_wait.
EVENTS_EXCHANGE = "sked.events"
# Producers publish task specs here (routing key `submit`); the scheduler consumes SUBMIT_QUEUE.
TASKS_EXCHANGE = "sked.tasks"
SUBMIT_KEY = "submit"
WORKFLOW_KEY = "submit.workflow"  # a whole workflow (shared.dag.WorkflowSpec) in one message
BATCH_KEY = "submit.batch"  # many tasks in one message (shared.intake.judge_batch)
SUBMIT_QUEUE = "sked.submit"
# Messages that cannot be accepted go to DEAD_QUEUE through DLX, the reason in REASON_HEADER.
DLX = "sked.dlx"
DEAD_QUEUE = "sked.dead"
# DEAD_QUEUE's bounds (SKED_DEAD_MAX_MESSAGES, SKED_DEAD_MAX_BYTES): past either RabbitMQ drops
# the oldest, so that a producer flooding bad messages cannot fill RabbitMQ's memory and disk
# (its alarms would block every publisher, sked's own included).
DEAD_MAX_MESSAGES = 100_000
DEAD_MAX_BYTES = 1024**3
# The scheduler sends each placed attempt to its node: routing key = node id.
DISPATCH_EXCHANGE = "sked.dispatch"
# Executors publish heartbeats (their own and their attempts') here; monitors share the queue.
HEARTBEATS_EXCHANGE = "sked.heartbeats"
HEARTBEATS_QUEUE = "sked.heartbeats"
# The heartbeat-monitor asks an executor about one attempt (request/reply, routing key node id).
PROBE_EXCHANGE = "sked.probe"
# A node's queue lives on for a day without its executor, then RabbitMQ drops it: by then
# recovery has moved anything dispatched to it elsewhere.
NODE_QUEUE_EXPIRES_MS = 24 * 3600 * 1000
SCHEMA_HEADER = "x-sked-schema"
JSON = "application/json"


KNOWN_STATES = frozenset(State)  # what this release routes as task.<state> as it is
_NOT_A_WORD = re.compile(r"[^a-z0-9_]")


def event_routing_key(state: str) -> str:
    """task.<state>. A state this release does not know (a newer release's, written during a
    rolling upgrade, or a hand-written row's) goes under its own name, made one bounded word."""
    if state in KNOWN_STATES:
        return f"task.{state}"
    return f"task.{_NOT_A_WORD.sub('_', state.lower())[:64] or 'unknown'}"


def node_queue(node_id: str) -> str:
    return f"sked.node.{node_id}"


@dataclass(frozen=True)
class Outgoing:
    routing_key: str
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    message_id: str | None = None


# The longest a publish waits for its confirms: a frozen link or a resource alarm (RabbitMQ
# blocks publishers, heartbeats still flow) held a dispatch pass, a producer's submit or an
# alert until AMQP heartbeats noticed, or for ever. TimeoutError is transient: retried.
PUBLISH_TIMEOUT_S = 10.0


class AmqpBus:
    """One robust connection and one confirming channel; declares the topology it uses."""

    def __init__(
        self, url: str, dead_max: tuple[int, int] = (DEAD_MAX_MESSAGES, DEAD_MAX_BYTES)
    ) -> None:
        self.url = url
        self.dead_max = dead_max  # DEAD_QUEUE's bounds: messages, bytes
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}
        self._requests = RequestReply(lambda: self.channel)  # request/reply (shared.bus_rpc)

    async def connect(self) -> None:
        """Connect and declare the exchanges and shared queues (idempotent)."""
        self._connection = await aio_pika.connect_robust(self.url)
        self._channel = channel = await self._connection.channel(publisher_confirms=True)
        for name, kind in (
            (EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC),
            (TASKS_EXCHANGE, aio_pika.ExchangeType.TOPIC),
            (DLX, aio_pika.ExchangeType.FANOUT),
            (DISPATCH_EXCHANGE, aio_pika.ExchangeType.DIRECT),
            (HEARTBEATS_EXCHANGE, aio_pika.ExchangeType.FANOUT),
            (PROBE_EXCHANGE, aio_pika.ExchangeType.DIRECT),
        ):
            self._exchanges[name] = await channel.declare_exchange(name, kind, durable=True)
        await self._declare_dead()
        await self.declare_submit_queue(channel)
        # a heartbeat is worth nothing after a few seconds: expire rather than pile up
        beats = await channel.declare_queue(
            HEARTBEATS_QUEUE, durable=True, arguments={"x-message-ttl": 10_000}
        )
        await beats.bind(self._exchanges[HEARTBEATS_EXCHANGE])

    async def _declare_dead(self) -> None:
        """DEAD_QUEUE, bounded by `dead_max` (drop-head: the oldest go first; dropping the
        newest instead would refuse intake's dead-lettering, and stall intake). A queue made
        earlier with other bounds, or none, keeps them, as RabbitMQ never changes a queue's
        arguments: it is used as it is, with a warning (a policy can bound it: README). The
        arguments that hold are declared on the bus's channel, which declares them again after
        a reconnect (a RabbitMQ that lost its queues gets this one back)."""
        assert self._channel is not None
        messages, size = self.dead_max
        bounds: dict[str, Any] = {
            "x-max-length": messages,
            "x-max-length-bytes": size,
            "x-overflow": "drop-head",
        }
        for arguments in (bounds, None):
            if await self._declarable(DEAD_QUEUE, arguments):
                dead = await self._channel.declare_queue(
                    DEAD_QUEUE, durable=True, arguments=arguments
                )
                break
        else:  # bounds an operator set by hand: passive, so not declared again on reconnect
            dead = await self._channel.declare_queue(DEAD_QUEUE, passive=True)
        if arguments is not bounds:
            log.warning(
                "%s exists with other bounds than %d messages and %d bytes, which RabbitMQ"
                " refuses to change; kept as it is. A policy can bound it (README).",
                DEAD_QUEUE,
                messages,
                size,
            )
        await dead.bind(self._exchanges[DLX])

    async def _declarable(self, name: str, arguments: dict[str, Any] | None) -> bool:
        """Whether declaring queue `name` durable with `arguments` succeeds (it then exists):
        tried on a channel of its own, since a refusal (PRECONDITION_FAILED) closes it."""
        try:
            async with await self.open_channel() as channel:
                await channel.declare_queue(name, durable=True, arguments=arguments)
        except aiormq.exceptions.ChannelPreconditionFailed:
            return False
        return True

    async def consumer_channel(self, prefetch: int) -> AbstractChannel:
        """A channel of its own for consuming, so its prefetch bounds only that consumer."""
        channel = await self.open_channel()
        await channel.set_qos(prefetch_count=prefetch)
        return channel

    async def open_channel(self) -> AbstractChannel:
        """A new channel. Asked while the connection is down (dropped, not yet back), aiormq
        refuses with a bare RuntimeError that no loop retries: raised as AmqpAway instead, a
        ConnectionError (transient), so the asking loop waits and tries again."""
        if self._connection is None:
            raise RuntimeError("AmqpBus.connect() was not called")
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT_S):  # a silent link answers no open
                return await self._connection.channel()
        except RuntimeError as exc:
            raise AmqpAway(f"RabbitMQ connection down: {exc}") from exc

    async def declare_submit_queue(self, channel: AbstractChannel) -> AbstractQueue:
        """sked.submit and its bindings, declared (not looked up) on `channel`: a consumer's
        channel declares them again when it reopens, so a queue deleted under a running
        scheduler comes back (a passive lookup would wait for some other process to)."""
        submit = await channel.declare_queue(
            SUBMIT_QUEUE, durable=True, arguments={"x-dead-letter-exchange": DLX}
        )
        for key in (SUBMIT_KEY, WORKFLOW_KEY, BATCH_KEY):
            await submit.bind(TASKS_EXCHANGE, key)
        return submit

    async def node_queue_problem(self, node_id: str) -> str | None:
        """Declare node `node_id`'s queue, sked.dispatch and the binding again, on a channel
        of their own (a refusal closes it); why they cannot stand as sked declares them, or
        None. The broker tells no one of one deleted under a running executor."""
        what = f"exchange {DISPATCH_EXCHANGE} (direct, durable)"
        try:
            async with await self.open_channel() as channel:
                await channel.declare_exchange(
                    DISPATCH_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
                )
                what = f"queue {node_queue(node_id)} (x-expires {NODE_QUEUE_EXPIRES_MS})"
                await self.declare_node_queue(channel, node_id)
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            return f"{what} was declared by someone else otherwise: {exc}"
        except aiormq.exceptions.ChannelLockedResource as exc:  # another's exclusive queue
            return f"{what} is held exclusively by another connection: {exc}"
        except aiormq.exceptions.ChannelAccessRefused as exc:
            return f"{what} may not be declared by this user: {exc}"
        return None

    async def declare_node_queue(self, channel: AbstractChannel, node_id: str) -> AbstractQueue:
        queue = await channel.declare_queue(
            node_queue(node_id), durable=True, arguments={"x-expires": NODE_QUEUE_EXPIRES_MS}
        )
        await queue.bind(DISPATCH_EXCHANGE, node_id)
        return queue

    @property
    def channel(self) -> AbstractChannel:
        if self._channel is None:
            raise RuntimeError("AmqpBus.connect() was not called")
        return self._channel

    async def publish(self, exchange: str, messages: Sequence[Outgoing]) -> None:
        """Publish persistent messages and return once the broker confirmed every one.

        All are in flight at once: a confirm round trip per message caps throughput (figures in
        docs/performance.md). Raises if any is refused, or TimeoutError if the confirms take
        over PUBLISH_TIMEOUT_S; the caller then retries all of them (a dispatch takes its
        attempts back), which is why consumers must drop duplicates.
        """
        confirms = [self._send(exchange, m) for m in messages]
        # RabbitMQ hands a mandatory message no queue is bound for back, then confirms it
        # (publisher_confirms without on_return_raises): the confirm alone does not mean it
        # was queued. A dispatch for a node whose queue is gone (or not yet declared) must
        # raise, so the scheduler takes its attempt back rather than leave it to the sweep.
        async with asyncio.timeout(PUBLISH_TIMEOUT_S):
            confirmed = await asyncio.gather(*confirms)
        for sent in confirmed:
            if _returned(sent):
                raise aiormq.exceptions.PublishError(sent, sent.delivery)

    async def publish_each(
        self, exchange: str, messages: Sequence[Outgoing], timeout: float
    ) -> list[Exception | None]:
        """Publish persistent messages, all in flight at once, and say what became of each, in
        their order: None if the broker confirmed it; the error if it refused it (DeliveryError,
        a nack: a queue bound with `x-overflow: reject-publish` was full, say, while the other
        queues took it) or the publish failed; TimeoutError if no confirm came within `timeout`
        seconds (a frozen link, a resource alarm: whether it went out is unknown)."""
        if not messages:
            return []
        sending = [asyncio.ensure_future(self._send(exchange, m)) for m in messages]
        pending: set[asyncio.Future[Any]] = set(sending)
        try:
            _, pending = await asyncio.wait(sending, timeout=timeout)
        finally:
            for future in pending:  # unconfirmed after the timeout, or all on a cancel
                future.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        outcomes: list[Exception | None] = []
        for future in sending:
            if future in pending:
                outcomes.append(TimeoutError(f"no confirm within {timeout:.1f} s"))
                continue
            exc = future.exception()
            if exc is not None and not isinstance(exc, Exception):
                raise exc
            if exc is None and _returned(sent := future.result()):
                exc = aiormq.exceptions.PublishError(sent, sent.delivery)
            outcomes.append(exc)
        return outcomes

    async def _send(self, exchange: str, m: Outgoing) -> Any:
        """Publish one persistent message; returns its confirmation."""
        return await self._exchanges[exchange].publish(
            aio_pika.Message(
                m.body,
                content_type=JSON,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers=m.headers,
                message_id=m.message_id,
            ),
            routing_key=m.routing_key,
            # Events go to whoever subscribed, and none may have: a mandatory publish would
            # have RabbitMQ send every such message back whole (most of the relay's traffic,
            # when nobody listens). Elsewhere a queue is expected.
            mandatory=exchange != EVENTS_EXCHANGE,
        )

    async def request(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        timeout: float,
        correlation_id: str | None = None,
        accept: Accept | None = None,
    ) -> bytes | Unroutable | None:
        """Publish a request and wait, `timeout` seconds at most in all, for the first answer
        `accept` takes: its body; UNROUTABLE if no consumer is bound for `routing_key`; None
        otherwise (shared.bus_rpc.RequestReply.request)."""
        return await self._requests.request(
            self._exchanges[exchange], routing_key, body, timeout, correlation_id, accept
        )

    async def reply(self, request: AbstractIncomingMessage, body: bytes) -> None:
        """Answer a request on its reply_to queue (default exchange), with its correlation id."""
        await self.channel.default_exchange.publish(
            aio_pika.Message(body, content_type=JSON, correlation_id=request.correlation_id),
            routing_key=request.reply_to or "",
        )

    async def dead_letter(
        self, body: bytes, reason: str, routing_key: str, headers: dict[str, Any] | None = None
    ) -> None:
        """Park a message we cannot accept in DEAD_QUEUE, with why, for an operator to see.
        Returned (DEAD_QUEUE deleted under us: the broker tells no one), the queue is declared
        again and the message sent once more; a refusal that is still not parked raises, and
        intake hands its batch back rather than lose it."""
        note = {**(headers or {}), REASON_HEADER: reason[:2000], "x-sked-routing-key": routing_key}
        try:
            await self.publish(DLX, [Outgoing(routing_key, body, note)])
        except aiormq.exceptions.PublishError:
            await self._declare_dead()
            await self.publish(DLX, [Outgoing(routing_key, body, note)])

    async def peek_dead(self, limit: int) -> list[DeadLetter]:
        """Up to `limit` messages of DEAD_QUEUE, oldest first, left where they are: each is
        taken without an acknowledgement on a channel of its own, which is then closed, so
        RabbitMQ puts every one back in its place."""
        letters: list[DeadLetter] = []
        async with await self.open_channel() as channel:
            queue = await channel.declare_queue(DEAD_QUEUE, passive=True)
            while len(letters) < limit:
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    break
                letters.append(
                    dead_letter_of(
                        message.body, message.headers, message.routing_key, message.message_id
                    )
                )
        return letters

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
            self._channel = None
            self._requests.reset()
