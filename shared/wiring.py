"""Opening and closing what a service talks to: one place, so every `__main__` wires alike."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import asyncpg
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisDown
from redis.exceptions import TimeoutError as RedisTimeout

from shared import metrics, queues
from shared.bus import AmqpBus
from shared.errors import SkedError, postgres_said, rabbitmq_said
from shared.queues import ReadyQueue
from shared.runtime import Service, serve
from shared.settings import Settings
from shared.store import Store
from shared.store.db import COMMAND_S, CONNECT_S
from shared.store.migrate import require_migrated


def where(url: str) -> str:
    """host:port of a server's URL, never its password."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "localhost", parts.port
    except ValueError:  # (Settings refuses such a URL; a caller may not have read it so)
        return "(its URL)"
    return f"{host}:{port}" if port else host


@asynccontextmanager
async def starting(server: str, url: str) -> AsyncIterator[None]:
    """Around a server's first connect at a service's start: its refusal, or its silence past
    CONNECT_S, as one line naming it (SkedError; run_main logs it and exits 1 for the
    supervisor to restart) instead of a traceback through its client library, or a wait
    without end on a port that accepts and never answers."""
    try:
        async with asyncio.timeout(CONNECT_S):
            yield
    except (SkedError, asyncpg.InvalidCatalogNameError):
        raise  # (no such database: connect_store says to run `sked migrate`)
    except TimeoutError:
        raise SkedError(f"{server} at {where(url)} did not answer within {CONNECT_S:g} s") from None
    except Exception as exc:
        said = postgres_said(exc) or rabbitmq_said(exc)
        if said is None and isinstance(exc, OSError):  # refused, unresolvable
            said = str(exc) or type(exc).__name__
        if said is None:
            raise
        raise SkedError(f"{server} at {where(url)}: {said}") from None


@dataclass(frozen=True)
class Backends:
    settings: Settings
    store: Store
    redis: Redis
    bus: AmqpBus

    @property
    def ready_queue(self) -> ReadyQueue:
        return ReadyQueue(self.redis, self.settings.aging_s)


def idle_in_tx_s(settings: Settings) -> float:
    """How long a service's session may sit idle in an open transaction before Postgres ends
    it (db.create_pool): half the node TTL. The longest a service waits inside one on purpose
    is a Redis call (the dispatch pass pops under the nodes' row locks), and a node's heartbeat
    that queues behind those locks for this long still lands within its TTL."""
    return settings.node_ttl_s / 2


def relay_idle_in_tx_s(settings: Settings) -> float:
    """The same for a service that relays the outbox (the relay, recovery): its pass holds
    its shards while it waits for RabbitMQ's confirms, up to SKED_RELAY_CONFIRM_TIMEOUT_S."""
    return settings.relay_confirm_timeout_s + idle_in_tx_s(settings)


def node_statement_s(settings: Settings) -> float:
    """The bound on each statement of a service that keeps nodes' rows alive (the executor:
    its node heartbeat, its claims and outcomes), past which its connection is dropped and the
    statement's loop retries on another (db.pooled): half the node TTL. A connection gone
    silent (a NAT that dropped its state) held the heartbeat for asyncpg's 60 s, and the node
    was gone to placement; given up at half the TTL, the retry lands within it. Not shorter:
    the longest such a statement waits on purpose is the nodes' row locks a dispatch pass holds,
    which Postgres ends at half the TTL too (idle_in_tx_s), and a statement's round trips,
    even at 300 ms each way, take a second or two."""
    return settings.node_ttl_s / 2


async def connect_store(
    settings: Settings,
    size: int | None = None,
    idle_s: float | None = None,
    statement_s: float = COMMAND_S,
) -> Store:
    """The store of a service, which refuses (SkedError, one line) to start on a database that
    is not there or whose schema is older than this code: it would answer every request with a
    missing table (services start beside `sked migrate`, and their supervisor restarts them)."""
    try:
        async with starting("Postgres", settings.database_url):
            store = await Store.connect(
                settings.database_url,
                size or settings.db_pool_size,
                settings.lease_margin_s,
                settings.node_ttl_s,
                idle_s,
                statement_s,
            )
    except asyncpg.InvalidCatalogNameError as exc:
        raise SkedError(f"Postgres: {exc}: run `sked migrate` (it creates it)") from None
    try:
        await require_migrated(store.pool)
    except BaseException:
        await store.close()
        raise
    return store


@asynccontextmanager
async def backends(
    settings: Settings, idle_s: float | None = None, statement_s: float = COMMAND_S
) -> AsyncIterator[Backends]:
    """Postgres, Redis and RabbitMQ for `settings`, closed on the way out; `idle_s`: the
    store's bound on a transaction left idle, `statement_s` on a statement (db.create_pool)."""
    store = await connect_store(settings, idle_s=idle_s, statement_s=statement_s)
    redis = queues.connect(settings.redis_url)
    bus = AmqpBus(settings.rabbitmq_url, settings.dead_max)
    try:
        await _refused_by_redis(redis, settings.redis_url)
        async with starting("RabbitMQ", settings.rabbitmq_url):
            await bus.connect()
        yield Backends(settings, store, redis, bus)
    finally:
        await bus.close()
        await redis.aclose()
        await store.close()


async def _refused_by_redis(redis: Redis, url: str) -> None:
    """Redis refusing this service (a database index it does not have, a wrong password) is
    a mistake in its settings; Redis down or silent is an outage the services ride out
    (shared/degrade.py), so only a refusal stops the start."""
    try:
        async with asyncio.timeout(CONNECT_S):
            await redis.ping()
    except AuthenticationError as exc:  # (a ConnectionError to redis-py)
        raise SkedError(f"Redis at {where(url)}: {exc}") from None
    except (RedisDown, RedisTimeout, TimeoutError, OSError):
        return
    except RedisError as exc:
        raise SkedError(f"Redis at {where(url)}: {exc}") from None


def serving(
    build: Callable[[Settings, Backends], Service | Awaitable[Service]],
    idle_s: Callable[[Settings], float] = idle_in_tx_s,
    statement_s: Callable[[Settings], float] | None = None,
) -> Callable[[Settings], Awaitable[None]]:
    """A service process's async main: open the backends, build the service on them (a build
    may be async: an API client needs the running loop), serve it until SIGTERM (standing for
    computing the cluster-wide gauges meanwhile, with metrics on), close the backends.
    `idle_s`: its sessions' bound on a transaction left idle, by its settings; `statement_s`:
    on a statement (None: db.COMMAND_S, for services whose passes and batches run long)."""

    async def main(settings: Settings) -> None:
        bound = COMMAND_S if statement_s is None else statement_s(settings)
        async with backends(settings, idle_s(settings), bound) as b:
            built = build(settings, b)
            service = await built if inspect.isawaitable(built) else built
            async with metrics.cluster(settings, b.store, b.ready_queue):
                await serve(service)

    return main
