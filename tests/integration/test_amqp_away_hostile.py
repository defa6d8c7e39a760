"""RabbitMQ's connection dropped under a running service, and the moment before the robust
connection is back: what the bus and the executor's periodic declarations do in that window.
The drop is made by a proxy between the service and RabbitMQ (tests/faults/proxy.py), so it
lands at a moment the test chooses rather than by chance."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from shared.bus import AmqpBus
from shared.fsm import State
from shared.resilience import is_transient
from shared.settings import Settings
from tests.faults.proxy import Proxy
from tests.integration.pipeline import services
from tests.integration.test_amqp_hostile import _all_succeed

# robust connections try again after this long: the window in which the connection is down
RECONNECT_S = 3


@contextlib.asynccontextmanager
async def _proxied(url: str) -> AsyncIterator[tuple[Proxy, str]]:
    proxy = await Proxy(5672).start()
    try:
        yield proxy, f"{proxy.url(url)}?reconnect_interval={RECONNECT_S}"
    finally:
        await proxy.close()


async def _dropped(proxy: Proxy) -> None:
    """Every connection through `proxy` reset, and the clients given a moment to see it."""
    proxy.cut()
    proxy.heal()
    await asyncio.sleep(0.3)


async def test_a_channel_asked_of_a_dropped_connection_fails_as_transient(
    settings: Settings,
) -> None:
    """The connection drops; before the robust connection is back, the bus is asked for a
    consumer's channel, a node queue's declaration, and a look at the dead letters. Should:
    each fails with an error every loop retries (shared.resilience.TRANSIENT). aiormq said it
    with a bare RuntimeError ("<Connection ...> closed"), which no loop retries: the service
    asking stopped (an executor's periodic declarations did, in a CI run that restarted
    RabbitMQ). Now the bus raises AmqpAway, a ConnectionError."""
    async with _proxied(settings.rabbitmq_url) as (proxy, url):
        bus = AmqpBus(url)
        await bus.connect()
        try:
            await _dropped(proxy)
            asks = {
                "consumer_channel": bus.consumer_channel(1),
                "node_queue_problem": bus.node_queue_problem("n1"),
                "peek_dead": bus.peek_dead(1),
            }
            raised: dict[str, BaseException | None] = {}
            for name, ask in asks.items():
                try:
                    await asyncio.wait_for(ask, RECONNECT_S - 1)
                    raised[name] = None
                except Exception as exc:
                    raised[name] = exc
        finally:
            await bus.close()
    refused = {k: repr(e) for k, e in raised.items() if e is not None and not is_transient(e)}
    assert not refused, f"refused with errors no loop retries: {refused}"


async def test_an_executor_s_declarations_while_its_connection_is_down(
    settings: Settings, tmp_path: Path
) -> None:
    """An executor's link to RabbitMQ drops, and its nodes loop declares its queues again
    (Serving.reassert, every fifth heartbeat) before the connection is back. Should: it waits
    for a later heartbeat, and once the connection is back the node
    runs tasks. Asked of a closed connection, a channel was refused with a bare RuntimeError
    that stopped the nodes loop and with it the executor, as a CI run's restart of RabbitMQ
    once did by chance (b88beda mended reassert by catching RuntimeError there)."""
    async with (
        _proxied(settings.rabbitmq_url) as (proxy, url),
        services(settings, tmp_path, "away", rabbitmq_url=url) as running,
    ):
        serving = running.executor.serving
        assert serving is not None
        await _dropped(proxy)
        failed: BaseException | None = None
        try:
            await asyncio.wait_for(serving.reassert(), RECONNECT_S - 1)
        except Exception as exc:
            failed = exc
        assert failed is None or is_transient(failed), f"reassert refused: {failed!r}"
        assert await _all_succeed(running.client, 2, 60) == [State.SUCCESS] * 2
