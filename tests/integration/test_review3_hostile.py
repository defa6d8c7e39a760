"""A second adversarial review of the fourteenth session's own code (fb4b96b..39c84ae: the
scheduler's Redis gate, the renewals' bounds). Each case failed on that code: the docstrings say
what happened; each test shows it no longer does. Held up: Redis flapping every 0.5 s for 10 s
then cut 20 s under a single scheduler (all 30 tasks succeeded, no hot loop while paused)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from services.scheduler.service import Scheduler
from shared.client import SkedClient
from shared.fsm import State
from shared.settings import Settings
from tests.faults.proxy import Proxy
from tests.helpers import spec
from tests.integration.pipeline import services

RECONNECT_S = 10


@contextlib.asynccontextmanager
async def _running(
    settings: Settings, tmp_path: Path, sched: Settings
) -> AsyncIterator[tuple[Scheduler, SkedClient]]:
    async with services(settings, tmp_path, "r3", sched, slots=2) as running:
        yield running.scheduler, running.client


async def _until(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.1)
    return False


async def test_a_gate_resume_failing_on_a_dropped_rabbitmq_is_tried_again(
    settings: Settings, tmp_path: Path
) -> None:
    """A single scheduler (Redis and RabbitMQ through proxies, robust reconnect after 10 s)
    and an executor. Redis is cut and a task A submitted: intake times out, sets
    hub.redis_away, the gate cancels the sked.submit consumer. Then the scheduler's RabbitMQ
    connection drops and Redis heals while it is down. After RabbitMQ is back (15 s) task B is
    submitted. Should: the gate consumes again once both answer; A and B succeed. The gate's
    ping succeeded, it cleared redis_away, then `consume()` on the closed channel raised;
    supervise restarted the gate, which waited for redis_away (now clear) for ever, and the
    cancelled consumer is not among those the robust queue restores: A and B were never
    admitted while the scheduler looked up. Now the gate remembers it is paused, and clears
    the mark only once it consumes again."""
    rp, ap = await Proxy(6379).start(), await Proxy(5672).start()
    try:
        sched = settings.model_copy(
            update={
                "redis_url": rp.url(settings.redis_url),
                "rabbitmq_url": f"{ap.url(settings.rabbitmq_url)}?reconnect_interval={RECONNECT_S}",
            }
        )
        async with _running(settings, tmp_path, sched) as (scheduler, client):
            first = await client.submit(spec("warm"))
            await client.wait_all([first], timeout=30)
            rp.cut()
            a = await client.submit(spec("a"))
            assert await _until(scheduler.hub.redis_away.is_set, 20), "gate never closed"
            await asyncio.sleep(1)
            ap.cut()
            ap.heal()  # RabbitMQ's connection drops; back in RECONNECT_S
            rp.heal()  # Redis answers again while it is down
            await asyncio.sleep(RECONNECT_S + 5)
            b = await client.submit(spec("b"))
            try:
                done = await client.wait_all([a, b], timeout=40)
                states = [t.status for t in done.values()]
            except TimeoutError as exc:
                states = [f"timeout: {exc}"]
            assert states == [State.SUCCESS] * 2, (
                f"redis_away={scheduler.hub.redis_away.is_set()} states={states}"
            )
    finally:
        await rp.close()
        await ap.close()


async def test_renewals_on_a_slow_link_keep_a_20s_lease(settings: Settings) -> None:
    """A LeaseLink connected (statement prepared), then its link to Postgres gets 1.2 s each
    way; renewals every 2 s exactly as Watcher.run asks them (timeout=period,
    connecting=what is left of a 20 s lease), for 60 s. Should: the lease is renewed before it
    lapses (a 2.4 s round trip fits a 20 s lease many times). With deb384a's bounds the
    renewal on the live connection was cut at the period (2 s) and the connection dropped; the
    fresh one (about 7 round trips, ~17 s) got only what was left (14 s) and failed; from then
    on every renewal failed. Now a renewal on a connection made before has half of what is
    left of the lease (a silent one is still given up while a fresh connection fits)."""
    from uuid import uuid4

    from shared.store.leases import LeaseLink
    from tests.faults.test_latency import slow_proxy

    lease, period = 20.0, 2.0
    async with slow_proxy(5432) as pg:
        link = LeaseLink(pg.url(settings.database_url), 0.5)
        owner, keys = uuid4(), [(uuid4(), 1)]
        await link.renew(owner, keys, 10.0)  # connected, statement prepared, before the delay
        pg.fixed(1.2)
        held = time.monotonic()
        gaps, log = [], []
        end = held + 60
        try:
            while time.monotonic() < end:
                await asyncio.sleep(period)
                sent = time.monotonic()
                left = max(0.0, lease - (sent - held))
                try:
                    await link.renew(owner, keys, period, left)
                    gaps.append(round(sent - held, 1))
                    held = sent
                    log.append(f"ok {time.monotonic() - sent:.1f}s")
                except Exception as exc:
                    log.append(f"{type(exc).__name__} {time.monotonic() - sent:.1f}s")
            gaps.append(round(time.monotonic() - held, 1))
        finally:
            link.close()
        assert max(gaps) < lease, f"gaps {gaps}; {log}"
