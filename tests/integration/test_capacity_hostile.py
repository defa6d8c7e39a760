"""Placement beside a node whose dispatches come back (a live row, no queue bound for it),
with several schedulers, on real Postgres, Redis and RabbitMQ. Fake nodes are registered
straight in the store (no executor: nobody claims, so what is placed stays Scheduling).

An adversarial round (2026-12-07) also drove three schedulers through bursts of mixed
resource needs while nodes were cordoned, relabelled, re-registered with fewer slots and
other boot ids: an audit trigger on every placement found no node over its slots, backlog,
cpu, memory or gpu, no label mismatch, nothing on a cordoned or not-ready node, nothing lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any
from uuid import uuid4

import aiormq.exceptions
from redis.asyncio import Redis

from services.scheduler import sending
from services.scheduler.dispatch import Dispatcher
from services.scheduler.hub import Hub
from services.scheduler.service import Scheduler
from shared.bus import Outgoing
from shared.client import SkedClient
from shared.fsm import State
from shared.queues import ReadyQueue
from shared.settings import Settings
from shared.store import Store
from shared.wiring import backends
from tests.fakes import StubBus
from tests.helpers import spec


@contextlib.asynccontextmanager
async def cluster(settings: Settings, schedulers: int) -> AsyncIterator[Any]:
    """`schedulers` in-process schedulers on the test's deployment, with n0's dispatch queue
    declared (nobody consumes it) and no queue for any other node."""
    async with contextlib.AsyncExitStack() as stack:
        b = await stack.enter_async_context(backends(settings))
        await b.bus.declare_node_queue(await b.bus.consumer_channel(1), "n0")
        for _ in range(schedulers):
            s = await stack.enter_async_context(backends(settings))
            await stack.enter_async_context(Scheduler(settings, s.store, s.bus, s.ready_queue))
        yield b


async def test_a_node_without_its_queue_does_not_stall_the_others(settings: Settings) -> None:
    """Two schedulers; a healthy node n0 (4 slots, its queue declared) beside a live node row
    `ghost` (8 slots) whose dispatch queue is gone (RabbitMQ returns its messages: the case
    the docs name, "no queue bound for the node: it expired, or was not declared yet").
    12 tasks are submitted. n0 should hold its 4 attempts within 3 s: the ghost's returned
    messages should take back the ghost's attempts only. Every pass placed on both nodes
    (the ghost is the emptiest), and the ghost's returned message made Dispatcher.send take
    back every attempt of the pass, n0's included: n0 held nothing, ~100 take-backs. Now
    only a failed message's attempts go back, and the ghost is passed over (UNROUTABLE_S)."""
    s = settings.model_copy(update={"degrade_gpu_ratio": 1.0})
    async with cluster(s, 2) as b:
        await b.store.nodes.register("n0", 4, 0.0, 0, 0, {}, uuid4())
        await b.store.nodes.register("ghost", 8, 0.0, 0, 0, {}, uuid4())
        async with SkedClient(s) as client:
            job = {"kind": "command", "argv": ["true"]}
            await client.submit_many([{"name": f"g{i}", "job": job} for i in range(12)])
            await asyncio.sleep(3.0)
        placed = await b.store.tasks.list_tasks([State.SCHEDULING])
        on_n0 = [t for t in placed if t.node == "n0"]
        assert len(on_n0) == 4, f"n0 holds {len(on_n0)} of its 4 slots after 3 s"


async def test_a_returned_dispatch_leaves_the_pass_unplaced_tasks_in_line(
    settings: Settings,
) -> None:
    """One dispatch pass over 6 Ready tasks of 1 cpu each, nodes n0 (4 slots, 1 cpu, queue
    declared) and ghost (4 slots, 1 cpu, its queue gone: RabbitMQ returns its message). The
    pass pops 6 (8 free slots), places 2 (one per cpu) and has 4 left that wait for room.
    Whatever becomes of the returned dispatch, the 4 unplaced tasks, popped from the ready
    line, must be back in it (or parked) when the pass ends. They were in no Redis set at
    all (left to the reconcile sweep), because send() raised before hand_over() queued
    them. Now hand_over queues what waits whatever send does."""
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        await b.bus.declare_node_queue(await b.bus.consumer_channel(1), "n0")
        await b.store.nodes.register("n0", 4, 1.0, 0, 0, {}, uuid4())
        await b.store.nodes.register("ghost", 4, 1.0, 0, 0, {}, uuid4())
        ready = await b.store.tasks.create_many(
            [spec(f"t{i}", resources={"cpu": 1}) for i in range(6)],
            walk=(State.PENDING, State.READY),
        )
        await scheduler.queue.push(ready)
        with contextlib.suppress(Exception):  # the returned dispatch raises; not the point
            await scheduler.dispatch.dispatch_once()
        tasks = await b.store.tasks.list_tasks([State.READY])
        absent = await scheduler.queue.absent([t.id for t in tasks])
        assert absent == [], f"{len(absent)} of {len(tasks)} Ready tasks in no queue"


ADMISSION = (State.PENDING, State.READY)


def _returned() -> Exception:
    """The error publish_each gives a message RabbitMQ returned (no queue bound)."""
    return aiormq.exceptions.PublishError.__new__(aiormq.exceptions.PublishError)


class ReturningBus(StubBus):
    """A broker with no queue bound for node `g` the first time: its message comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.returned = 0

    async def publish_each(
        self, exchange: str, messages: Sequence[Outgoing], timeout: float
    ) -> list[Exception | None]:
        out: list[Exception | None] = []
        for m in messages:
            if m.routing_key == "g" and not self.returned:
                self.returned += 1
                out.append(_returned())
            else:
                self.published.append((exchange, m))
                out.append(None)
        return out


async def test_a_task_that_fits_only_an_unroutable_node_waits_in_line_not_parked(
    store: Store, settings: Settings, redis_url: str, monkeypatch: object
) -> None:
    """Node g (pool=gpu) and node p (no labels). A dispatch to g comes back once (its queue
    unbound for a moment: Sender.send marks g unroutable for UNROUTABLE_S). The next pass
    (Dispatcher.dispatch_once) placed on `hub.routable(rows)`, which left g out, so a task
    whose selector only g matches is judged "no node matches" and PARKED (sked:parked), with
    that false reason written. Parked tasks come back only on a node change (NOTIFY sked_node)
    or the reconciler's backstop every PRUNE_S (60 s); the unroutable window's end is neither.
    Expected: once g's window is over, the dispatch loop places the task on g. It stayed
    Ready and parked (up to a minute more, wrongly reasoned) though g was healthy. Now an
    unroutable node is shown full (Hub.routable): what fits it waits in line for it."""
    monkeypatch.setattr(sending, "UNROUTABLE_S", 0.3)  # type: ignore[attr-defined]
    redis = Redis.from_url(redis_url)
    try:
        queue, bus, hub = ReadyQueue(redis, aging_s=10.0), ReturningBus(), Hub()
        await queue.mark_built()
        dispatcher = Dispatcher(settings, store, bus, queue, hub)  # type: ignore[arg-type]
        gpu = {"pool": "gpu"}
        await store.nodes.register("g", 2, 0.0, 0, 0, gpu, uuid4())
        await store.nodes.register("p", 2, 0.0, 0, 0, {}, uuid4())
        # a first task for g: its dispatch comes back, g is passed over for the window
        (first, _), *_ = await store.tasks.admit_many(
            [spec("first", selector=gpu)], [uuid4()], ADMISSION
        )
        await queue.push([first])
        await dispatcher.dispatch_once()
        assert bus.returned == 1
        assert "g" in hub.unroutable
        # within the window another task for g is judged: nothing but g could take it
        (second, _), *_ = await store.tasks.admit_many(
            [spec("second", selector=gpu)], [uuid4()], ADMISSION
        )
        await queue.push([second])
        await dispatcher.dispatch_once()
        await asyncio.sleep(0.5)  # the window is over: g is routable again
        # what the dispatch loop does on its next wake-ups (Dispatcher.run)
        for _ in range(3):
            if hub.unpark.is_set():
                hub.unpark.clear()
                await queue.unpark()
            await dispatcher.dispatch_once()
        after = {t.id: t for t in await store.tasks.get_many([first.id, second.id])}
        depths = await queue.depths()
    finally:
        await redis.aclose()
    stuck = [t for t in after.values() if t.status is State.READY]
    assert not stuck, (
        f"after node g's unroutable window, {len(stuck)} task(s) only g can take stay Ready "
        f"(parked: {depths.get('parked')}), reason {[t.status_reason for t in stuck]!r}"
    )
