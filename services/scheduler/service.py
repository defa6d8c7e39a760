"""The scheduler: one replica of any number, against the same Postgres, Redis and RabbitMQ.

intake     submissions in batches -> Created -> Pending -> Ready (intake.py)
follow-up  the dispatch messages of admissions' placements their nodes did not claim (follow.py)
dispatch   pop by aged priority, place under the nodes' locks, send each attempt (dispatch.py)
retries    RetryWait tasks whose backoff ran out -> Ready (retries.py)
timeouts   tasks not started within their schedule timeout -> Failed, final (timeouts.py)
reconcile  the Redis queue against Postgres (reconcile.py)
workflows  release or skip Pending workflow tasks as upstreams finish (resolve.py)
degrade    the degrade mode dispatch obeys; the automatic triggers and alerts (degrade.py)

They share one wake-up hub (hub.py): what each NOTIFY, and each loop's result, wakes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

from aio_pika.abc import AbstractChannel

from services.scheduler.degrade import Degrade
from services.scheduler.dispatch import Dispatcher
from services.scheduler.hub import Hub
from services.scheduler.intake import Intake
from services.scheduler.reconcile import Reconciler
from services.scheduler.resolve import Resolver
from services.scheduler.retries import Retries
from services.scheduler.timeouts import ScheduleTimeouts
from shared.alerts import Alerter
from shared.bus import SUBMIT_QUEUE, AmqpBus
from shared.queues import ReadyQueue
from shared.resilience import TRANSIENT, supervise
from shared.service import Loop, Service
from shared.settings import Settings
from shared.store import DEGRADE_CHANNEL, NODE_CHANNEL, TASK_CHANNEL, Handler, Store


class Scheduler(Service):
    name = "scheduler"

    def __init__(self, settings: Settings, store: Store, bus: AmqpBus, queue: ReadyQueue) -> None:
        super().__init__(settings, store)
        self.bus = bus
        self.queue = queue
        self.hub = hub = Hub()
        self.dispatch = Dispatcher(settings, store, bus, queue, hub)
        self.intake = Intake(settings, store, bus, queue, hub, self.dispatch)
        self.retries = Retries(settings, store, queue, hub)
        self.timeouts = ScheduleTimeouts(settings, store, queue, hub)
        self.reconciler = Reconciler(settings, store, queue, hub)
        self.resolver = Resolver(settings, store, queue, hub)
        self.alerter = Alerter(bus, settings.alertmanager_url)
        self.degrade = Degrade(settings, store, queue, hub, bus, self.alerter)
        self._channel: AbstractChannel | None = None

    def loops(self) -> Sequence[Loop]:
        stop = self.stopping
        return [
            ("intake", self.intake.run),
            ("dispatch follow-up", functools.partial(self.intake.follower.run, stop)),
            ("dispatch", functools.partial(self.dispatch.run, stop)),
            ("retry sweep", functools.partial(self.retries.run, stop)),
            ("schedule timeouts", functools.partial(self.timeouts.run, stop)),
            ("reconcile", functools.partial(self.reconciler.run, stop)),
            ("workflows", functools.partial(self.resolver.run, stop)),
            ("degrade", functools.partial(self.degrade.run, stop)),
        ]

    def channels(self) -> Sequence[tuple[str, Handler]]:
        return [
            (TASK_CHANNEL, self.hub.task_notify),
            (NODE_CHANNEL, self.hub.node_notify),
            (DEGRADE_CHANNEL, self.hub.degrade_notify),
        ]

    def missed(self) -> None:
        self.hub.missed()

    async def setup(self) -> None:
        await supervise("rebuild the ready queue", self._rebuild, self.stopping)
        self._channel = await self.bus.consumer_channel(prefetch=self.settings.submit_batch * 2)
        submit = await self.bus.declare_submit_queue(self._channel)
        await submit.consume(self.intake.inbox.put)

    async def _rebuild(self) -> None:
        await self.reconciler.rebuild()

    def announce(self) -> str:
        return f"scheduler consuming {SUBMIT_QUEUE}"

    async def teardown(self) -> None:
        await self.alerter.close()
        if self._channel is not None:
            with contextlib.suppress(*TRANSIENT):
                await self._channel.close()

    def on_stop(self) -> None:
        self.intake.inbox.put_nowait(None)
