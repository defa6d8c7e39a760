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
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar
from uuid import UUID

import redis.exceptions
from redis.asyncio import Redis

from shared.resilience import CacheDamaged
from shared.throttle import Throttled

log = logging.getLogger(__name__)
_FOREIGN = Throttled(log)  # members that name no task: whoever can write to Redis may add them

READY_KEY = "sked:ready"
# Ready tasks no node can take at all (too big, wrong labels) wait here, with their scores,
# so they cannot block the head of the queue; a node joining or changing moves them back.
PARKED_KEY = "sked:parked"
# Workflow tasks whose named resource is fully held wait here: in line they would take the
# head of the queue (and the free slots it is popped for) from tasks that could run. A holder
# ending moves them back.
RESOURCE_KEY = "sked:parked:resource"
# Resumed tasks an earlier attempt still holds a lease for (paused while its executor could not
# hear it) wait here until the lease ends or is given back: in line they too would take the
# head and its free slots. A task end, a lease given back, or the reconcile period moves them.
FENCED_KEY = "sked:parked:fenced"
_PARKED = (PARKED_KEY, RESOURCE_KEY, FENCED_KEY)
_SETS = (READY_KEY, *_PARKED)
BUILT_KEY = "sked:ready:built"  # gone after FLUSHALL or a restart without persistence
EPOCH = datetime(2025, 1, 1, tzinfo=UTC).timestamp()

# KEYS[1] parked set -> KEYS[2] ready set, keeping the lower score of a task in both. In
# chunks: Lua's unpack has a stack limit of a few thousand values.
# the line's length and whether it is built (BUILT_KEY), in one command
_WAITING = "return {redis.call('ZCARD', KEYS[1]), redis.call('EXISTS', KEYS[2])}"
_UNPARK = """
local moved = 0
while true do
  local chunk = redis.call('ZRANGE', KEYS[1], 0, 999, 'WITHSCORES')
  if #chunk == 0 then return moved end
  local add, members = {}, {}
  for i = 1, #chunk, 2 do
    add[#add + 1] = chunk[i + 1]
    add[#add + 1] = chunk[i]
    members[#members + 1] = chunk[i]
  end
  redis.call('ZADD', KEYS[2], 'LT', unpack(add))
  redis.call('ZREM', KEYS[1], unpack(members))
  moved = moved + #members
end
"""


# Every command's answer and every connect is bounded: a Redis that stops answering must fail a
# pass (a transient error, retried), never hang it while it holds the nodes' row locks
# (redis-py before 8 waits for ever by default).
TIMEOUT_S = 5.0


def connect(url: str) -> Redis:
    """A client for the queue's Redis, its commands and connects bounded by TIMEOUT_S."""
    return Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)


class Queued(Protocol):
    @property
    def id(self) -> UUID: ...
    @property
    def priority(self) -> int: ...
    @property
    def queued_at(self) -> datetime | None: ...


# With no aging (SKED_AGING_S=0), strict priority: each step of priority outweighs any wait
# (~30 years); FIFO within a priority, to the millisecond while priorities are within +-1000.
STRICT_S = 1e9


def score(priority: int, queued_at: datetime, aging_s: float) -> float:
    return (queued_at.timestamp() - EPOCH) - priority * (aging_s or STRICT_S)


P = ParamSpec("P")
T = TypeVar("T")


def _repairing(
    method: Callable[Concatenate[ReadyQueue, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[ReadyQueue, P], Coroutine[Any, Any, T]]:
    """A queue key of another type (a stray SET or HSET by another client of the same Redis)
    answers every command with WRONGTYPE, which no retry mends: the key is deleted (Redis
    holds nothing Postgres cannot rebuild), with the built marker so the next reconcile
    rebuilds, and CacheDamaged raised, which the service's loop retries."""

    async def repairing(self: ReadyQueue, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(self, *args, **kwargs)
        except redis.exceptions.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            await self.repair()
            raise CacheDamaged(f"the ready queue was damaged and is rebuilt: {exc}") from exc

    return repairing


class ReadyQueue:
    """Pops are atomic (ZPOPMIN): two schedulers never receive the same task id."""

    def __init__(self, redis: Redis, aging_s: float) -> None:
        self.redis = redis
        self.aging_s = aging_s
        self._unpark = redis.register_script(_UNPARK)
        self._waiting = redis.register_script(_WAITING)

    def score_of(self, task: Queued) -> float:
        queued = task.queued_at or datetime.now(UTC)
        return score(task.priority, queued, self.aging_s)

    @_repairing
    async def push(self, tasks: Iterable[Queued], *, back: bool = False) -> int:
        """Queue tasks at their scores. `back`: tasks a pass popped and puts back as it read
        them — one queued again meanwhile (an operator's new priority) keeps that entry."""
        mapping = {str(t.id): self.score_of(t) for t in tasks}
        if not mapping:
            return 0
        await self.redis.zadd(READY_KEY, mapping, nx=back)
        return len(mapping)

    async def pop(self, n: int) -> list[UUID]:
        return [task_id for task_id, _ in await self.pop_scored(n)]

    @_repairing
    async def pop_scored(self, n: int) -> list[tuple[UUID, float]]:
        """The `n` first in line, with the scores they were queued with. A member that names
        no task id is dropped (logged); one id spelt twice (UUID() reads upper case, braces,
        no dashes alike) is taken once."""
        if n <= 0:
            return []
        popped: list[tuple[bytes | str, float]] = await self.redis.zpopmin(READY_KEY, n)  # type: ignore[assignment]
        out: dict[UUID, float] = {}
        foreign = []
        for member, score in popped:
            try:
                task_id = UUID(_text(member))
            except ValueError:  # UnicodeDecodeError too
                foreign.append(member)
                continue
            out.setdefault(task_id, float(score))
        if foreign:
            _FOREIGN.warning(
                "dropped %d member(s) of %s that name no task (first: %r)",
                len(foreign),
                READY_KEY,
                foreign[0][:80],
            )
        return list(out.items())

    @_repairing
    async def remove(self, ids: Sequence[UUID]) -> None:
        if ids:
            members = [str(i) for i in ids]
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.zrem(READY_KEY, *members)
                for key in _PARKED:
                    pipe.zrem(key, *members)
                await pipe.execute()

    @_repairing
    async def park(self, tasks: Iterable[Queued], key: str = PARKED_KEY) -> int:
        """Set tasks aside (with their scores) until `unpark(key)`: PARKED_KEY for tasks no
        node can take, RESOURCE_KEY for tasks waiting for a named resource, FENCED_KEY for
        tasks waiting for an earlier attempt's lease."""
        mapping = {str(t.id): self.score_of(t) for t in tasks}
        if mapping:
            await self.redis.zadd(key, mapping)
        return len(mapping)

    @_repairing
    async def unpark(self, key: str = PARKED_KEY) -> int:
        """Move every task parked under `key` back into the queue, in one atomic step.

        O(m log n) for m parked tasks, nothing when none is: it runs on every task end (for
        the resource waiters), where a ZUNIONSTORE would rewrite the whole ready set each time.
        """
        return int(await self._unpark(keys=[key, READY_KEY]))

    @_repairing
    async def size(self) -> int:
        return int(await self.redis.zcard(READY_KEY))

    @_repairing
    async def waiting(self) -> int | None:
        """How many are in line, read with the built marker in one command (a script: a
        pipeline of the two cost intake ~50 µs more of the client's CPU, on the path of every
        lone submission); None when Redis lost the line and it is not rebuilt yet: then
        anything may be waiting."""
        count, built = await self._waiting(keys=[READY_KEY, BUILT_KEY])
        return int(count) if built else None

    @_repairing
    async def depths(self) -> dict[str, int]:
        """Tasks in line ("ready"), parked because no node can take them ("parked"), waiting
        for a named resource ("resource"), and for an earlier attempt's lease ("fenced")."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in _SETS:
                pipe.zcard(key)
            counts = await pipe.execute()
        names = ("ready", "parked", "resource", "fenced")
        return dict(zip(names, map(int, counts), strict=True))

    @_repairing
    async def absent(self, ids: Sequence[UUID]) -> list[UUID]:
        """Those of `ids` that are neither queued nor parked."""
        if not ids:
            return []
        members = [str(i) for i in ids]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in (READY_KEY, *_PARKED):
                pipe.zmscore(key, members)
            found = await pipe.execute()
        return [i for i, *scores in zip(ids, *found, strict=True) if all(s is None for s in scores)]

    async def repair(self) -> list[str]:
        """Delete the queue's keys that are not sorted sets (and the built marker with them,
        so that the queue is rebuilt); returns them."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in _SETS:
                pipe.type(key)
            kinds = await pipe.execute()
        bad = [key for key, kind in zip(_SETS, kinds, strict=True) if _text(kind) not in _ZSET]
        if bad:
            await self.redis.delete(*bad, BUILT_KEY)
            log.warning("queue key(s) %s held another type than a sorted set: deleted", bad)
        return bad

    @_repairing
    async def parked(self, key: str, start: int, count: int) -> list[bytes | str]:
        """Members of a parked set, by rank."""
        return await self.redis.zrange(key, start, start + count - 1)  # type: ignore[return-value]

    @_repairing
    async def unqueue(self, key: str, members: Sequence[bytes | str]) -> None:
        if members:
            await self.redis.zrem(key, *members)

    async def is_built(self) -> bool:
        return bool(await self.redis.exists(BUILT_KEY))

    async def mark_built(self) -> None:
        """Record that the queue holds every Ready task (gone again if Redis loses its data)."""
        await self.redis.set(BUILT_KEY, "1")


_ZSET = ("zset", "none")


def _text(member: bytes | str) -> str:
    return member.decode() if isinstance(member, bytes) else member


class ReadySource(Protocol):
    """Where the queue is rebuilt from: the task repository."""

    async def ready_for_queue(
        self, older_than_s: float, limit: int, after: Any = None
    ) -> Sequence[Queued]: ...

    async def ready_among(self, ids: Sequence[UUID]) -> set[UUID]: ...


PAGE = 5000  # Ready tasks read per round trip when rebuilding or reconciling


async def _pages(repo: ReadySource, older_than_s: float) -> AsyncIterator[Sequence[Queued]]:
    """Every Ready task queued more than `older_than_s` ago, oldest first, a page at a time."""
    after = None
    while True:
        page = await repo.ready_for_queue(older_than_s, PAGE, after)
        if page:
            yield page
        if len(page) < PAGE:
            return
        after = page[-1]


async def rebuild(queue: ReadyQueue, repo: ReadySource) -> int:
    """Put every Ready task of Postgres into the queue (after a Redis loss, at start)."""
    await queue.repair()
    total = 0
    async for page in _pages(repo, older_than_s=-1e9):
        total += await queue.push(page)
    await queue.mark_built()
    log.info("ready queue rebuilt from Postgres: %d tasks", total)
    return total


async def reconcile(queue: ReadyQueue, repo: ReadySource, older_than_s: float) -> int:
    """Rebuild the queue if Redis lost it; else re-add Ready tasks that have waited longer than
    `older_than_s` and are missing (their scheduler died between ZPOPMIN and its CAS) — all of
    them, however many, a page at a time."""
    if await queue.repair() or not await queue.is_built():
        log.warning("the ready queue is gone (Redis lost its data): rebuilding")
        return await rebuild(queue, repo)
    n = 0
    async for page in _pages(repo, older_than_s):
        missing = set(await queue.absent([t.id for t in page]))
        n += await queue.push([t for t in page if t.id in missing])
    if n:
        log.warning("re-queued %d Ready tasks the queue had lost", n)
    return n


async def prune_parked(queue: ReadyQueue, repo: ReadySource) -> int:
    """Drop the parked members whose task is no longer Ready (paused or canceled while
    parked) or that name no task: nothing else would, until a node joins or changes. A task
    that turns Ready again is queued anew by what readied it (or by `reconcile`)."""
    dropped = 0
    for key in _PARKED:
        start = 0
        while members := await queue.parked(key, start, PAGE):
            ids: dict[UUID, bytes | str] = {}
            stale: list[bytes | str] = []
            for member in members:
                try:
                    task_id = UUID(_text(member))
                except ValueError:
                    stale.append(member)
                    continue
                if task_id in ids:  # spelt twice: one member is enough
                    stale.append(member)
                else:
                    ids[task_id] = member
            ready = await repo.ready_among(list(ids))
            stale += [member for task_id, member in ids.items() if task_id not in ready]
            await queue.unqueue(key, stale)
            dropped += len(stale)
            start += len(members) - len(stale)
    if dropped:
        log.info("dropped %d parked member(s) of tasks no longer Ready", dropped)
    return dropped
