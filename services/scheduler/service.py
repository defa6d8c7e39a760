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
import logging
from collections.abc import Sequence

from aio_pika.abc import AbstractChannel, AbstractQueue

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
from shared.runtime import wait_any
from shared.service import Loop, Service
from shared.settings import Settings
from shared.store import DEGRADE_CHANNEL, NODE_CHANNEL, TASK_CHANNEL, Handler, Store

log = logging.getLogger(__name__)


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
        self._submit: AbstractQueue | None = None
        self._tag = ""
        self._paused = False  # the gate cancelled the sked.submit consumer: Redis is silent

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
            ("submissions gate", self._gate),
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
        self._submit = await self.bus.declare_submit_queue(self._channel)
        self._tag = await self._submit.consume(self.intake.inbox.put)

    async def _gate(self) -> None:
        """Submissions are taken only while Redis answers. A scheduler whose link to Redis is
        silent (cut, or Redis stalled) waited out its timeout on every batch and handed it back
        to RabbitMQ, which delivered half of them to it again: with another scheduler healthy
        and idle, submissions waited up to half a minute. It stops consuming instead until a
        ping is answered (once a second), and hands back at once what it holds (Intake.run)."""
        hub, stopping = self.hub, self.stopping
        while not stopping.is_set():
            assert self._submit is not None
            if not self._paused:  # (a gate restarted after a failed resume is still paused)
                await wait_any(hub.redis_away, stopping)
                if stopping.is_set():
                    return
                await self._submit.cancel(self._tag)
                self._paused = True
                log.warning("Redis does not answer: %s left to other schedulers", SUBMIT_QUEUE)
            while not stopping.is_set():
                with contextlib.suppress(*TRANSIENT):
                    await self.queue.redis.ping()
                    break
                await wait_any(stopping, timeout=1.0)
            if stopping.is_set():
                return
            # consumed again before the mark is cleared: a resume that fails on RabbitMQ (its
            # connection dropped meanwhile) is tried again, not forgotten for good
            self._tag = await self._submit.consume(self.intake.inbox.put)
            self._paused = False
            hub.redis_away.clear()
            log.info("Redis answers again: consuming %s", SUBMIT_QUEUE)

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
