"""Opening and closing what a service talks to: one place, so every `__main__` wires alike."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg
from redis.asyncio import Redis

from shared import metrics, queues
from shared.bus import AmqpBus
from shared.errors import SkedError
from shared.queues import ReadyQueue
from shared.runtime import Service, serve
from shared.settings import Settings
from shared.store import Store
from shared.store.migrate import require_migrated


@dataclass(frozen=True)
class Backends:
    settings: Settings
    store: Store
    redis: Redis
    bus: AmqpBus

    @property
    def ready_queue(self) -> ReadyQueue:
        return ReadyQueue(self.redis, self.settings.aging_s)


async def connect_store(settings: Settings, size: int | None = None) -> Store:
    """The store of a service, which refuses (SkedError, one line) to start on a database that
    is not there or whose schema is older than this code: it would answer every request with a
    missing table (services start beside `sked migrate`, and their supervisor restarts them)."""
    try:
        store = await Store.connect(
            settings.database_url,
            size or settings.db_pool_size,
            settings.lease_margin_s,
            settings.node_ttl_s,
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
async def backends(settings: Settings) -> AsyncIterator[Backends]:
    """Postgres, Redis and RabbitMQ for `settings`, closed on the way out."""
    store = await connect_store(settings)
    redis = queues.connect(settings.redis_url)
    bus = AmqpBus(settings.rabbitmq_url, settings.dead_max)
    try:
        await bus.connect()
        yield Backends(settings, store, redis, bus)
    finally:
        await bus.close()
        await redis.aclose()
        await store.close()


def serving(
    build: Callable[[Settings, Backends], Service | Awaitable[Service]],
) -> Callable[[Settings], Awaitable[None]]:
    """A service process's async main: open the backends, build the service on them (a build
    may be async: an API client needs the running loop), serve it until SIGTERM (standing for
    computing the cluster-wide gauges meanwhile, with metrics on), close the backends."""

    async def main(settings: Settings) -> None:
        async with backends(settings) as b:
            built = build(settings, b)
            service = await built if inspect.isawaitable(built) else built
            async with metrics.cluster(settings, b.store, b.ready_queue):
                await serve(service)

    return main
