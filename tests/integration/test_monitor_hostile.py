"""The heartbeat-monitor's loss ladder under a hostile bus and flaky servers: the probe
answers it believes, the deadlines it restarts, the rungs it remembers, and a probe that
cannot be sent (services/heartbeat_monitor/ladder.py, service.py; shared/bus_rpc.py;
shared/heartbeat.py `answer`/`believe`; shared/store/sql/monitor.sql).

These cases were found by an adversarial review; each docstring says what the code did then
and what holds now."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Literal
from uuid import UUID, uuid4

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from services.heartbeat_monitor.ladder import Ladder
from services.heartbeat_monitor.service import HeartbeatMonitor
from shared import fsm, heartbeat
from shared.bus import PROBE_EXCHANGE, UNROUTABLE, AmqpBus
from shared.client import SkedClient
from shared.fsm import State
from shared.heartbeat import ProbeAnswer
from shared.models import Task
from shared.outcome import Report
from shared.settings import Settings
from shared.store import Store
from shared.store.db import Db
from shared.store.monitor import MonitorDeadlines
from tests.helpers import spec

TIMEOUT = 1.0  # the shortest heartbeat timeout a spec may ask for


async def running_on(store: Store, node: str, owner: UUID | None = None) -> Task:
    """A task Running on `node` under a lease of `owner` (by default an executor that no
    longer exists)."""
    task = await store.tasks.create(spec(heartbeat_timeout_s=TIMEOUT))
    for target, changes in (
        (State.PENDING, {}),
        (State.READY, {}),
        (State.SCHEDULING, {"node": node}),
        (State.RUNNING, {"lease_owner": str(owner or uuid4())}),
    ):
        task = await fsm.apply(store.tasks, task, target, **changes)
    return task


def quick(settings: Settings) -> Settings:
    return settings.model_copy(update={"monitor_port": 0, "heartbeat_flush_s": 0.05})


@contextlib.asynccontextmanager
async def monitor(settings: Settings, store: Store) -> AsyncIterator[HeartbeatMonitor]:
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    service = HeartbeatMonitor(quick(settings), store, bus)
    try:
        async with service:
            await asyncio.wait_for(service.ready.wait(), 10)
            yield service
    finally:
        await bus.close()


Answer = Callable[[str, bytes], bytes]  # (correlation id, probe) -> the answer's body


def forged(answer: ProbeAnswer) -> Answer:
    """The same answer to every probe, signed by nobody."""
    return lambda _correlation, _probe: answer.model_dump_json().encode()


def signed(secret: str, state: Literal["running", "finished", "frozen", "unknown"]) -> Answer:
    """An answer as an executor holding the secret makes it (heartbeat.answer)."""

    def make(correlation: str, probe: bytes) -> bytes:
        asked = heartbeat.Probe.model_validate_json(probe)
        report = Report(ok=True, result={"by": "the executor"}) if state == "finished" else None
        return (
            heartbeat.answer(secret, correlation, asked, state, report).model_dump_json().encode()
        )

    return make


@contextlib.asynccontextmanager
async def impostor(
    settings: Settings, node: str, answer: Answer, delay_s: float = 0.0
) -> AsyncIterator[list[str]]:
    """Any client of the bus (a sidecar that publishes heartbeats holds the same credentials):
    it binds a queue of its own to `sked.probe` under a node's id — a direct exchange copies
    each probe to every queue bound with that key — and answers each probe it sees (after
    `delay_s`), to the monitor's reply queue with the probe's own correlation id. Yields the
    probes seen."""
    seen: list[str] = []
    connection = await aio_pika.connect(settings.rabbitmq_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(PROBE_EXCHANGE, node)

        async def on_probe(message: AbstractIncomingMessage) -> None:
            seen.append(message.body.decode())
            await asyncio.sleep(delay_s)
            await channel.default_exchange.publish(
                aio_pika.Message(
                    answer(message.correlation_id or "", message.body),
                    correlation_id=message.correlation_id,
                ),
                routing_key=message.reply_to or "",
            )

        await queue.consume(on_probe, no_ack=True)
        yield seen


async def keep_fresh(store: Store, node: str, boot: UUID, stop: asyncio.Event) -> None:
    """The node's row as its executor keeps it while the executor lives (every 0.5 s)."""
    while not stop.is_set():
        await store.nodes.heartbeat(node, boot, 0.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def settle(store: Store, task_id: UUID, seconds: float) -> Task:
    """The task once it left Running, or as it is after `seconds`."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        task = await store.tasks.get(task_id)
        if task.status is not State.RUNNING or asyncio.get_running_loop().time() > deadline:
            return task
        await asyncio.sleep(0.1)


# -- 1. a probe answer is believed from whoever sends it -------------------------------------


async def test_a_forged_finished_answer_does_not_end_an_attempt_with_the_forgers_result(
    settings: Settings, store: Store
) -> None:
    """The ladder took the first reply carrying the probe's correlation id as the executor's
    word. Anyone on the bus sees every probe (bind a queue to the direct exchange `sked.probe`
    under the node's id), so it could answer "finished" with a report of its own: the monitor
    then wrote Running -> Success with the forger's result, as if the task had produced it.
    The attempt's executor is gone here; the only correct ends are Lost (then a retry)."""
    node = f"n-{uuid4().hex[:8]}"
    boot = uuid4()
    await store.nodes.register(node, 2, 2.0, 1024, 0, {}, boot)
    task = await running_on(store, node)
    fake = ProbeAnswer(state="finished", report=Report(ok=True, result={"owned": "by the forger"}))
    stop = asyncio.Event()
    fresh = asyncio.create_task(keep_fresh(store, node, boot, stop))
    try:
        async with (
            monitor(settings, store) as service,
            impostor(settings, node, forged(fake)) as seen,
        ):
            after = await settle(store, task.id, 15.0)
            refused = service.ladder.refused
    finally:
        stop.set()
        await fresh
    assert seen, "the impostor saw no probe: the test proves nothing"
    assert (after.status, after.result) != (State.SUCCESS, {"owned": "by the forger"}), (
        f"a forged probe answer ended the task: {after.status.label}, result {after.result!r}; "
        f"events: {[(e.to_status.label, e.reason) for e in await store.tasks.history(task.id)]}"
    )
    assert after.status is State.LOST
    assert refused >= 1  # counted


async def test_a_forged_answer_sent_first_does_not_silence_the_executors_own(
    settings: Settings, store: Store
) -> None:
    """The first reply with the probe's correlation id settled the probe, whoever sent it: a
    forger answering "unknown" before the executor had the attempt Lost at once, though its
    executor was about to report its real outcome. A reply that is not believed is now
    dropped, and the wait goes on for the executor's."""
    node = f"n-{uuid4().hex[:8]}"
    boot = uuid4()
    await store.nodes.register(node, 2, 2.0, 1024, 0, {}, boot)
    task = await running_on(store, node)
    secret = settings.require_heartbeat_secret()
    stop = asyncio.Event()
    fresh = asyncio.create_task(keep_fresh(store, node, boot, stop))
    try:
        async with (
            monitor(settings, store),
            impostor(settings, node, forged(ProbeAnswer(state="unknown"))),
            impostor(settings, node, signed(secret, "finished"), delay_s=0.3) as seen,
        ):
            after = await settle(store, task.id, 8.0)
    finally:
        stop.set()
        await fresh
    assert seen, "the executor saw no probe: the test proves nothing"
    assert (after.status, after.result) == (State.SUCCESS, {"by": "the executor"}), (
        f"{after.status.label}: {[e.reason for e in await store.tasks.history(task.id)][-1:]}"
    )


def test_only_an_answer_signed_for_its_probe_is_believed() -> None:
    """An answer names the attempt it is about and carries a MAC under the heartbeat secret
    over the probe's correlation id and the exact bytes sent; before, there was neither, and
    every well-formed answer was believed."""
    secret, cid = "s" * 32, uuid4().hex
    probe = heartbeat.Probe(task_id=uuid4(), attempt=2)
    report = Report(ok=True, result={"x": [0.1, 1e300, -0.0, 2**70, "é\u2028😀"]})
    body = heartbeat.answer(secret, cid, probe, "finished", report).model_dump_json().encode()
    assert heartbeat.believe(secret, cid, probe, body).report == report
    other = heartbeat.Probe(task_id=probe.task_id, attempt=3)
    made_for_other = heartbeat.answer(secret, cid, other, "running").model_dump_json().encode()
    refused = {
        "wrong secret": (
            heartbeat.answer("t" * 32, cid, probe, "running").model_dump_json().encode()
        ),
        "other correlation": (
            heartbeat.answer(secret, uuid4().hex, probe, "running").model_dump_json().encode()
        ),
        "another attempt's": made_for_other,
        "tampered": body.replace(b"0.1", b"0.2"),
        "unsigned": ProbeAnswer(state="running").model_dump_json().encode(),
        "mac moved": body.replace(b'"state"', b'"mac":null,"state"', 1),
        "not json": b"running",
    }

    believed = heartbeat.believer(secret, cid, probe)
    assert [why for why, forged_body in refused.items() if believed(forged_body)] == []


async def test_a_running_answer_does_not_keep_an_attempt_running_without_its_lease(
    settings: Settings, store: Store
) -> None:
    """The attempt's lease is renewed by no one (its executor is gone: the node's row is
    fresh because the executor restarted, or another of the node's runs). Whoever answers
    "running" to each probe — here signed, as an executor would — restored the deadline every
    time: RESTORE never looked at the lease, so the attempt stayed Running for ever, never
    Lost, never retried. A "running" now restores only while the lease is live; without it
    is as good as "frozen": a grace to twice the timeout since its lease (2 s), then Lost.
    We give it 8 s."""
    node = f"n-{uuid4().hex[:8]}"
    boot = uuid4()
    await store.nodes.register(node, 2, 2.0, 1024, 0, {}, boot)
    task = await running_on(store, node)
    secret = settings.require_heartbeat_secret()
    stop = asyncio.Event()
    fresh = asyncio.create_task(keep_fresh(store, node, boot, stop))
    try:
        async with (
            monitor(settings, store),
            impostor(settings, node, signed(secret, "running")) as seen,
        ):
            after = await settle(store, task.id, 8.0)
    finally:
        stop.set()
        await fresh
    assert seen, "no probe was answered: the test proves nothing"
    lease = await store.tasks.get(task.id)
    assert after.status is State.LOST, (
        f"still {after.status.label} after 8 s, lease_until {lease.lease_until} never renewed; "
        f"{len(seen)} probe(s) answered 'running', each restoring the deadline"
    )
    lost = [e for e in await store.tasks.history(task.id) if e.to_status is State.LOST]
    assert "running, but its lease lapsed" in lost[-1].reason


# -- 2. deadlines restarted by anyone's start -------------------------------------------------


async def test_restarts_of_another_monitor_replica_do_not_keep_an_attempt_from_being_judged(
    settings: Settings, store: Store
) -> None:
    """Every monitor's start (and every transient failure of its sweep loop) ran
    `restart_deadlines`, which gave EVERY Running attempt a timeout + margin from now. The
    executors renew in Postgres, not through the monitor: a monitor's restart cost them
    nothing. One replica that restarted more often than the shortest timeout + margin (a
    crash loop, a flaky link of its own) kept every replica from ever judging anything: the
    attempt of a node that is gone stayed Running. The restart is now anchored to Postgres's
    own start. Here one replica runs throughout
    while another restarts every 0.7 s; the attempt's lease ran out at 1 s, so it is due
    (node gone: Lost at once) at 1.5 s. We allow 8 s."""
    task = await running_on(store, f"gone-{uuid4().hex[:8]}")
    async with monitor(settings, store):
        loop = asyncio.get_running_loop()
        end = loop.time() + 8.0
        restarts = 0
        after = task
        while loop.time() < end:
            async with monitor(settings, store):
                restarts += 1
            after = await settle(store, task.id, 0.7)
            if after.status is not State.RUNNING:
                break
    assert after.status is State.LOST, (
        f"still {after.status.label} 8 s after its lease ran out at 1 s (node gone): "
        f"{restarts} restart(s) of a second monitor each pushed its deadline; "
        f"hb_deadline {after.hb_deadline}, lease_until {after.lease_until}"
    )


async def test_a_lost_postgres_gives_a_timeout_anew_only_to_leases_that_lapsed_meanwhile(
    store: Store,
) -> None:
    """After its sweep failed on Postgres, a monitor restarted every Running attempt's
    deadline: a monitor whose own link to Postgres flaps kept every dead attempt from being
    judged. Now only the attempts whose lease lapsed since it last reached Postgres get a
    timeout anew (executors could not renew then), and each lease once: the restart never
    moves a lease, so the next failure finds it lapsed before."""
    deadlines = MonitorDeadlines(Db(store.pool, store.lease_margin_s))
    before = await running_on(store, f"n-{uuid4().hex[:8]}")  # lapses before the "outage"
    await asyncio.sleep(TIMEOUT + 0.2)
    _, _, since = await deadlines.clock()
    during = await running_on(store, f"n-{uuid4().hex[:8]}")  # lapses within it
    await asyncio.sleep(TIMEOUT + store.lease_margin_s + 0.1)
    assert await deadlines.restart_after_outage(since) == 1
    assert (await store.tasks.get(before.id)).hb_deadline == before.hb_deadline
    pushed = await store.tasks.get(during.id)
    assert pushed.hb_deadline is not None
    assert pushed.lease_until is not None
    assert pushed.hb_deadline > pushed.lease_until + timedelta(seconds=TIMEOUT)
    _, _, later = await deadlines.clock()
    assert await deadlines.restart_after_outage(later) == 0  # a next failure: not again
    assert await deadlines.restart_at_boot() == 0  # Postgres has been up for long


# -- 3. the ladder's memory of rungs -----------------------------------------------------------


async def test_the_ladder_forgets_an_attempt_that_ended_after_its_grace(
    settings: Settings, store: Store
) -> None:
    """`Ladder.rungs` kept the rungs of an attempt between sweeps while it was in grace, and
    dropped them only when this ladder took another rung for it. An attempt that ended any
    other way after a grace (its executor came back and reported; another replica judged
    it) was never dropped: one entry leaked per such attempt for the monitor's life — and
    the common case of a grace is an executor that recovers. Here: a grace, then the
    executor's outcome; the ladder goes on sweeping, and must let the attempt go."""
    node = f"n-{uuid4().hex[:8]}"
    boot = uuid4()
    await store.nodes.register(node, 2, 2.0, 1024, 0, {}, boot)
    task = await running_on(store, node)
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    try:
        # a connected executor that does not answer in time (busy, or its loop stalled)
        connection = await aio_pika.connect(settings.rabbitmq_url)
        async with connection:
            channel = await connection.channel()
            silent = await channel.declare_queue(exclusive=True, auto_delete=True)
            await silent.bind(PROBE_EXCHANGE, node)
            ladder = Ladder(store, bus, 0.3, settings.require_heartbeat_secret())
            await asyncio.sleep(TIMEOUT + store.lease_margin_s + 0.1)
            swept = await ladder.sweep(await store.leases.overdue(100, 5.3))
            assert swept == 1
            assert (task.id, 1) in ladder.rungs  # the grace rung, remembered
            # the executor comes back and reports the attempt's outcome
            current = await store.tasks.get(task.id)
            await fsm.apply(store.tasks, current, State.SUCCESS)
            for _ in range(5):
                await ladder.sweep(await store.leases.overdue(100, 5.3))
                await asyncio.sleep(0.1)
    finally:
        await bus.close()
    assert (task.id, 1) not in ladder.rungs, (
        f"the ended attempt is still held by the ladder: {ladder.rungs[(task.id, 1)]!r}"
    )


async def test_a_verdict_records_the_silence_of_its_own_episode_not_an_earlier_grace(
    settings: Settings, store: Store
) -> None:
    """The same leak, seen in the record: an attempt given a grace whose executor then came
    back (renewed) kept its old rungs in the ladder. When it fell silent again and was
    judged, `setdefault` reused them: the Lost event's reason stated the silence of the
    earlier episode ("lease not renewed for 1.6 s") and a grace it was not given this time,
    while this time it was silent for over 2 s and got none. A verdict's reason must say what
    was judged."""
    node = f"n-{uuid4().hex[:8]}"
    boot, owner = uuid4(), uuid4()
    await store.nodes.register(node, 2, 2.0, 1024, 0, {}, boot)
    task = await running_on(store, node, owner)
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    try:
        connection = await aio_pika.connect(settings.rabbitmq_url)
        async with connection:
            channel = await connection.channel()
            silent = await channel.declare_queue(exclusive=True, auto_delete=True)
            await silent.bind(PROBE_EXCHANGE, node)  # connected, never answers in time
            ladder = Ladder(store, bus, 0.3, settings.require_heartbeat_secret())
            await asyncio.sleep(TIMEOUT + store.lease_margin_s + 0.1)
            await ladder.sweep(await store.leases.overdue(100, 5.3))  # a grace
            assert await store.leases.renew(owner, [(task.id, 1)]) == {(task.id, 1)}  # back
            await store.nodes.heartbeat(node, boot, 0.0)
            await asyncio.sleep(2 * TIMEOUT + 0.3)  # silent again, past twice the timeout
            await store.nodes.heartbeat(node, boot, 0.0)
            for _ in range(20):
                await ladder.sweep(await store.leases.overdue(100, 5.3))
                if (await store.tasks.get(task.id)).status is not State.RUNNING:
                    break
                await asyncio.sleep(0.1)
    finally:
        await bus.close()
    lost = [e for e in await store.tasks.history(task.id) if e.to_status is State.LOST]
    assert lost, "never judged"
    reason = lost[-1].reason
    silence = float(reason.split("lease not renewed for ")[1].split(" s")[0])
    assert silence >= 2 * TIMEOUT, f"Lost with a reason from an earlier episode: {reason!r}"


async def timed_request(bus: AmqpBus, node: str) -> tuple[object, float]:
    """A probe of 1 s through `bus`: what it gave, and how long it took."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    asked = await bus.request(PROBE_EXCHANGE, node, b"{}", 1.0)
    return asked, loop.time() - began


# -- 4. a probe that cannot be sent holds the whole sweep -------------------------------------


async def test_a_monitor_cut_off_from_rabbitmq_still_judges_an_attempt_whose_node_is_gone(
    settings: Settings, store: Store
) -> None:
    """`AmqpBus.request` bounded the wait for the answer (`wait_for(answer, timeout)`) but not
    the publish before it, which waited for RabbitMQ's confirm with no limit (every other
    publish has PUBLISH_TIMEOUT_S). When the monitor's link to RabbitMQ swallowed packets (a
    partition; or RabbitMQ blocking publishers on a resource alarm), the first probe of a
    sweep hung — and the sweep gathered all its climbs, so it applied no verdict at all,
    not even for an attempt whose node is gone by Postgres's own rows (no probe needed).
    The loop never failed, so it never recovered until AMQP heartbeats noticed (minutes).
    A request is now bounded as a whole, and verdicts that need no probe go first.
    Here: attempt A on a node whose row is fresh (it is probed), attempt B on a node that
    has no row at all (Lost as soon as its lease + margin ran out, at 1.5 s). We allow 8 s."""
    from tests.faults.proxy import Proxy

    port = int(settings.rabbitmq_url.split("127.0.0.1:")[1].split("/")[0])
    proxy = await Proxy(port).start()
    cut_settings = settings.model_copy(update={"rabbitmq_url": proxy.url(settings.rabbitmq_url)})
    assert cut_settings.rabbitmq_url != settings.rabbitmq_url
    node = f"n-{uuid4().hex[:8]}"
    boot = uuid4()
    await store.nodes.register(node, 2, 2.0, 1024, 0, {}, boot)
    probed = await running_on(store, node)
    orphan = await running_on(store, f"gone-{uuid4().hex[:8]}")
    stop = asyncio.Event()
    fresh = asyncio.create_task(keep_fresh(store, node, boot, stop))
    bus = AmqpBus(cut_settings.rabbitmq_url)
    await asyncio.wait_for(bus.connect(), 10)
    service = HeartbeatMonitor(quick(cut_settings), store, bus)
    running = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(service.ready.wait(), 10)
        # a probe before the cut (to a node nobody serves): its reply queue exists, so what
        # hangs below is the publish itself
        assert await bus.request(PROBE_EXCHANGE, "nobody", b"{}", 1.0) is UNROUTABLE
        proxy.cut()  # the monitor <-> RabbitMQ link swallows packets; Postgres is fine
        after = await settle(store, orphan.id, 8.0)
        first = await store.tasks.get(probed.id)
        asked, took = await timed_request(bus, node)
    finally:
        stop.set()
        service.stop()
        proxy.heal()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 30)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(bus.close(), 10)
        await proxy.close()
        await fresh
    assert after.status is State.LOST, (
        f"the attempt of a node that has no row is still {after.status.label} 8 s after its "
        f"lease ran out (the probed one: {first.status.label}): the sweep is stuck in a probe's "
        f"publish"
    )
    assert (asked, took < 2.0) == (None, True), f"a 1 s request gave {asked!r} in {took:.1f} s"


async def test_a_monitor_whose_rabbitmq_is_down_still_judges_an_attempt_whose_node_is_gone(
    settings: Settings, store: Store
) -> None:
    """RabbitMQ goes away from a monitor that has not probed yet since it started. The first
    probe made the reply queue (`AmqpBus.request`: `declare_queue` on the robust channel),
    which waited — with no bound — for the connection to come back; the probe's timeout
    covered only the wait for the answer. The sweep gathered all its climbs, so no verdict
    of the sweep was applied, not even that of an attempt whose node is gone by Postgres's
    own rows (no probe needed), and the loop never failed (no restart): nothing was judged
    until RabbitMQ returned. Here: attempt A on a node whose row is fresh (probed), attempt B on a
    node with no row (Lost as soon as its lease + margin ran out, at 1.5 s). We allow 10 s."""
    from tests.faults.proxy import Proxy

    port = int(settings.rabbitmq_url.split("127.0.0.1:")[1].split("/")[0])
    proxy = await Proxy(port).start()
    via = settings.model_copy(update={"rabbitmq_url": proxy.url(settings.rabbitmq_url)})
    node = f"n-{uuid4().hex[:8]}"
    boot = uuid4()
    await store.nodes.register(node, 2, 2.0, 1024, 0, {}, boot)
    stop = asyncio.Event()
    fresh = asyncio.create_task(keep_fresh(store, node, boot, stop))
    bus = AmqpBus(via.rabbitmq_url)
    await asyncio.wait_for(bus.connect(), 10)
    service = HeartbeatMonitor(quick(via), store, bus)
    running = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(service.ready.wait(), 10)
        await proxy.close()  # RabbitMQ gone for this monitor: connections reset, refused
        probed = await running_on(store, node)
        orphan = await running_on(store, f"gone-{uuid4().hex[:8]}")
        after = await settle(store, orphan.id, 10.0)
        first = await store.tasks.get(probed.id)
        asked, took = await timed_request(bus, node)
    finally:
        stop.set()
        service.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 30)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(bus.close(), 10)
        await fresh
    assert after.status is State.LOST, (
        f"the attempt of a node that has no row is still {after.status.label} 10 s after its "
        f"lease ran out (the probed one: {first.status.label}); hb_deadline {after.hb_deadline}"
    )
    assert (asked, took < 2.0) == (None, True), f"a 1 s request gave {asked!r} in {took:.1f} s"


# -- the live log -------------------------------------------------------------------------------


def with_log(secret: str, text: str) -> Answer:
    """A log probe's answer as the attempt's executor makes it."""

    def make(correlation: str, probe: bytes) -> bytes:
        asked = heartbeat.Probe.model_validate_json(probe)
        made = heartbeat.answer(secret, correlation, asked, "running", log=text)
        return made.model_dump_json().encode()

    return make


async def declared(settings: Settings) -> None:
    """The exchanges, as every service's bus declares them at its start."""
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    await bus.close()


async def test_the_live_log_is_taken_only_from_the_executors_signed_answer(
    settings: Settings, store: Store
) -> None:
    """`sked logs` of a running attempt (SkedClient.log) took the first answer to its probe,
    from anyone bound to `sked.probe`: a forger showed the operator a log of its own. Only an
    answer signed for the probe is taken now, and the wait goes on past others."""
    node = f"n-{uuid4().hex[:8]}"
    task = await running_on(store, node)
    secret = settings.require_heartbeat_secret()
    fake = ProbeAnswer(state="running", log="a log of the forger's")
    await declared(settings)
    async with (
        SkedClient(settings) as client,
        impostor(settings, node, forged(fake)),
        impostor(settings, node, with_log(secret, "the attempt's own log"), delay_s=0.3) as seen,
    ):
        assert await client.log(task.id, timeout=10) == "the attempt's own log"
    assert seen


async def test_without_the_secret_the_live_log_is_not_asked_for(
    settings: Settings, store: Store
) -> None:
    """A client that cannot check an answer does not take one: it shows the stored tail."""
    node = f"n-{uuid4().hex[:8]}"
    task = await running_on(store, node)
    fake = ProbeAnswer(state="running", log="a log of the forger's")
    blind = settings.model_copy(update={"heartbeat_secret": ""})
    await declared(settings)
    async with SkedClient(blind) as client, impostor(settings, node, forged(fake)) as seen:
        assert await client.log(task.id, timeout=2) is None
    assert seen == []
