"""The ready queue: one Redis sorted set ordered by aged priority, rebuildable from Postgres.

Score = (seconds since EPOCH at which the task became Ready) - priority * aging_s, and the
scheduler pops the lowest score. So a higher priority goes first, equal priorities go FIFO, and
waiting itself is the aging: a task queued at t is overtaken only by tasks queued before
t + (p_other - p) * aging_s, a finite set, so it never starves — and nothing is ever rescored
(every operation is O(log n)). docs/architecture.md states the bound.

Redis holds nothing Postgres cannot rebuild: the score comes from the task's row (priority,
queued_at), and a marker key tells whether the set was built since Redis last lost its data.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Protocol
from uuid import UUID

from redis.asyncio import Redis

log = logging.getLogger(__name__)

READY_KEY = "sked:ready"
BUILT_KEY = "sked:ready:built"  # gone after FLUSHALL or a restart without persistence
EPOCH = datetime(2025, 1, 1, tzinfo=UTC).timestamp()


class Queued(Protocol):
    @property
    def id(self) -> UUID: ...
    @property
    def priority(self) -> int: ...
    @property
    def queued_at(self) -> datetime | None: ...


def score(priority: int, queued_at: datetime, aging_s: float) -> float:
    return (queued_at.timestamp() - EPOCH) - priority * aging_s


class ReadyQueue:
    """Pops are atomic (ZPOPMIN): two schedulers never receive the same task id."""

    def __init__(self, redis: Redis, aging_s: float) -> None:
        self.redis = redis
        self.aging_s = aging_s

    def score_of(self, task: Queued) -> float:
        queued = task.queued_at or datetime.now(UTC)
        return score(task.priority, queued, self.aging_s)

    async def push(self, tasks: Iterable[Queued]) -> int:
        mapping = {str(t.id): self.score_of(t) for t in tasks}
        if not mapping:
            return 0
        await self.redis.zadd(READY_KEY, mapping)
        return len(mapping)

    async def pop(self, n: int) -> list[UUID]:
        if n <= 0:
            return []
        popped: list[tuple[bytes | str, float]] = await self.redis.zpopmin(READY_KEY, n)  # type: ignore[assignment]
        return [UUID(_text(member)) for member, _ in popped]

    async def remove(self, ids: Sequence[UUID]) -> None:
        if ids:
            await self.redis.zrem(READY_KEY, *(str(i) for i in ids))

    async def size(self) -> int:
        return int(await self.redis.zcard(READY_KEY))

    async def absent(self, ids: Sequence[UUID]) -> list[UUID]:
        """Those of `ids` that are not in the queue."""
        if not ids:
            return []
        scores = await self.redis.zmscore(READY_KEY, [str(i) for i in ids])
        return [i for i, s in zip(ids, scores, strict=True) if s is None]

    async def is_built(self) -> bool:
        return bool(await self.redis.exists(BUILT_KEY))

    async def rebuild(self, ready: Iterable[Queued]) -> int:
        """Add every given Ready task (scores are deterministic, so re-adding is harmless)."""
        total = 0
        batch: list[Queued] = []
        for task in ready:
            batch.append(task)
            if len(batch) >= 5000:
                total += await self.push(batch)
                batch = []
        total += await self.push(batch)
        await self.redis.set(BUILT_KEY, datetime.now(UTC).isoformat())
        log.info("ready queue rebuilt from Postgres: %d tasks", total)
        return total


def _text(member: bytes | str) -> str:
    return member.decode() if isinstance(member, bytes) else member
