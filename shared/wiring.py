"""Opening and closing what a service talks to: one place, so every `__main__` wires alike."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg
from redis.asyncio import Redis

from shared.bus import AmqpBus
from shared.nodes import PgNodeRepo
from shared.queues import ReadyQueue
from shared.repo import PgTaskRepo, create_pool
from shared.settings import Settings


@dataclass(frozen=True)
class Backends:
    settings: Settings
    pool: asyncpg.Pool
    redis: Redis
    bus: AmqpBus

    @property
    def tasks(self) -> PgTaskRepo:
        return PgTaskRepo(self.pool, self.settings.lease_margin_s)

    @property
    def nodes(self) -> PgNodeRepo:
        return PgNodeRepo(self.pool, self.settings.node_ttl_s)

    @property
    def ready_queue(self) -> ReadyQueue:
        return ReadyQueue(self.redis, self.settings.aging_s)


@asynccontextmanager
async def backends(settings: Settings) -> AsyncIterator[Backends]:
    """Postgres pool, Redis client and RabbitMQ bus for `settings`, closed on the way out."""
    pool = await create_pool(settings.database_url, settings.db_pool_size)
    redis = Redis.from_url(settings.redis_url)
    bus = AmqpBus(settings.rabbitmq_url)
    try:
        await bus.connect()
        yield Backends(settings, pool, redis, bus)
    finally:
        await bus.close()
        await redis.aclose()
        await pool.close()
