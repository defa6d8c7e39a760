"""The ready queue on real Redis: aged-priority order, atomic pops, and the two parked sets
(no node fits; waiting for a named resource), each moved back on its own signal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from uuid import UUID, uuid4

import pytest
from redis.asyncio import Redis

from shared import fsm, queues
from shared.fsm import State
from shared.queues import PARKED_KEY, RESOURCE_KEY, ReadyQueue
from shared.store import Store
from tests.helpers import spec


@dataclass(frozen=True)
class Item:
    id: UUID
    priority: int
    queued_at: datetime | None


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def item(priority: int = 0, waited_s: float = 0.0) -> Item:
    return Item(uuid4(), priority, T0 - timedelta(seconds=waited_s))


@pytest.fixture
async def queue(redis_url: str) -> AsyncIterator[ReadyQueue]:
    redis = Redis.from_url(redis_url)
    yield ReadyQueue(redis, aging_s=10.0)
    await redis.aclose()


async def test_aged_priority_order(queue: ReadyQueue) -> None:
    old_low = item(0, waited_s=25)  # 25 s of waiting outranks 2 levels (20 s)
    high = item(2)
    fifo = [item(1, waited_s=3), item(1, waited_s=2)]
    await queue.push([high, fifo[1], old_low, fifo[0]])
    assert await queue.pop(10) == [old_low.id, high.id, fifo[0].id, fifo[1].id]
    assert await queue.pop(1) == []


async def test_each_parked_set_comes_back_on_its_own_signal(queue: ReadyQueue) -> None:
    line, too_big, waits_lock = item(), item(5), item(9)
    await queue.push([line])
    await queue.park([too_big])
    await queue.park([waits_lock], RESOURCE_KEY)
    assert await queue.size() == 1
    stranger = uuid4()
    assert await queue.absent([line.id, too_big.id, waits_lock.id, stranger]) == [stranger]

    assert await queue.unpark(RESOURCE_KEY) == 1  # a task ended: the resource waiter returns
    assert await queue.pop(10) == [waits_lock.id, line.id]
    assert await queue.redis.zcard(PARKED_KEY) == 1  # the node-parked one stays aside
    assert await queue.unpark() == 1  # a node changed
    assert await queue.pop(10) == [too_big.id]


async def test_remove_takes_a_task_out_of_every_set(queue: ReadyQueue) -> None:
    a, b, c = item(), item(), item()
    await queue.push([a])
    await queue.park([b])
    await queue.park([c], RESOURCE_KEY)
    await queue.remove([a.id, b.id, c.id])
    assert sorted(await queue.absent([a.id, b.id, c.id])) == sorted([a.id, b.id, c.id])


async def test_unpark_moves_large_sets_and_keeps_the_better_score(queue: ReadyQueue) -> None:
    many = [item(0, waited_s=i) for i in range(2500)]  # more than one Lua chunk
    await queue.park(many)
    both = item(1)
    await queue.push([both])
    await queue.park([Item(both.id, 1, T0 - timedelta(seconds=100))])  # older: lower score
    assert await queue.unpark() == 2501
    assert await queue.size() == 2501
    assert await queue.redis.zscore("sked:ready", str(both.id)) == queue.score_of(
        Item(both.id, 1, T0 - timedelta(seconds=100))
    )
    assert await queue.unpark() == 0  # nothing parked: nothing to do


async def test_reconcile_finds_every_lost_ready_task_however_many(
    queue: ReadyQueue, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconciler reads stale Ready tasks a page at a time, to the end: with pages of 5,
    all 12 tasks Redis lost come back (it read only the first page before)."""
    monkeypatch.setattr(queues, "PAGE", 5)
    tasks = await store.tasks.create_many([spec(f"r{i}") for i in range(12)], walk=[State.PENDING])
    for task in tasks:
        await store.tasks.transition(fsm.plan(task, State.READY))
    await queue.mark_built()
    assert await queue.size() == 0
    assert await queues.reconcile(queue, store.tasks, older_than_s=0.0) == 12
    assert await queue.size() == 12
    assert await queues.reconcile(queue, store.tasks, older_than_s=0.0) == 0
    await queue.redis.delete(queues.BUILT_KEY)  # Redis lost everything: a rebuild, all pages
    await queue.redis.delete(queues.READY_KEY)
    assert await queues.reconcile(queue, store.tasks, older_than_s=0.0) == 12
