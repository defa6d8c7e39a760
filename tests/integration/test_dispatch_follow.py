"""The dispatch messages of an admission's placements, on real Postgres and RabbitMQ
(services/scheduler/follow.py): held while the node may claim from the notification, sent to
the node's queue for an attempt nobody claimed once the wait is over, and at once when the
scheduler stops. (A task its executor claims gets none: tests/integration/test_tracing.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from uuid import uuid4

from aio_pika.abc import AbstractIncomingMessage

from services.scheduler.service import Scheduler
from shared.dispatches import unpack
from shared.fsm import State
from shared.models import Dispatch
from shared.settings import Settings
from shared.wiring import backends
from tests.helpers import spec


@dataclass
class Rig:
    scheduler: Scheduler
    got: asyncio.Queue[AbstractIncomingMessage]  # what reaches node n1's queue
    stopping: asyncio.Event  # stops the follower's loop
    loop: asyncio.Task[None]

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.wait_for(self.loop, 10)


@contextlib.asynccontextmanager
async def rig(settings: Settings, wait_s: float) -> AsyncIterator[Rig]:
    """A scheduler whose follower waits `wait_s`, its loop running, and node n1 with its
    queue (no executor: nobody claims from the notification)."""
    followed = settings.model_copy(update={"dispatch_follow_s": wait_s})
    async with backends(followed) as b:
        scheduler = Scheduler(followed, b.store, b.bus, b.ready_queue)
        await scheduler.reconciler.rebuild()  # as at its start: the line is known whole
        queue = await b.bus.declare_node_queue(await b.bus.consumer_channel(4), "n1")
        got: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        await queue.consume(got.put)
        await b.store.nodes.register("n1", 4, 0.0, 0, 0, {}, uuid4())
        stopping = asyncio.Event()
        r = Rig(
            scheduler, got, stopping, asyncio.create_task(scheduler.intake.follower.run(stopping))
        )
        try:
            yield r
        finally:
            await r.stop()


async def dispatch_of(message: AbstractIncomingMessage) -> Dispatch:
    await message.ack()
    [entry] = unpack(message.body, message.headers)
    assert entry.dispatch is not None
    return entry.dispatch


async def test_an_unclaimed_placement_is_dispatched_to_its_node_once_the_wait_is_over(
    settings: Settings,
) -> None:
    async with rig(settings, 2.0) as r:  # sent from a second after the admission on
        [task], _ = await r.scheduler.intake.admit([spec("t1")], [uuid4()])
        assert (task.status, task.node) == (State.SCHEDULING, "n1")
        await asyncio.sleep(0.1)
        assert r.got.empty()  # the node may yet claim it from the notification
        dispatch = await dispatch_of(await asyncio.wait_for(r.got.get(), 10))
    assert (dispatch.task_id, dispatch.attempt) == (task.id, task.attempt)
    assert r.got.empty()  # once


async def test_a_stopping_scheduler_dispatches_what_it_still_holds_at_once(
    settings: Settings,
) -> None:
    async with rig(settings, 10.0) as r:
        [task], _ = await r.scheduler.intake.admit([spec("t1")], [uuid4()])
        await r.stop()
        message = await asyncio.wait_for(r.got.get(), 5)  # not the ten seconds' wait
        assert (await dispatch_of(message)).task_id == task.id
