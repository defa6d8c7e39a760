"""Task data and hostile headers flowing into events, traces, alerts and degrade modes, and
those parts under floods and odd timing: each case was found by an adversarial review (an
alert left firing or resolved early, a trace split, a span of 300 KB, recovery waiting on
Alertmanager, rolled-back moves counted). The docstrings say what happened; each test shows it
no longer does."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from redis.asyncio import Redis

from services.scheduler import degrade as degrade_service
from services.scheduler.degrade import Degrade
from services.scheduler.hub import Hub
from services.scheduler.service import Scheduler
from shared import modes
from shared.alerts import Alerter
from shared.bus import SCHEMA_HEADER, SUBMIT_KEY, TASKS_EXCHANGE, AmqpBus, Outgoing
from shared.degrade import Mode
from shared.fsm import State
from shared.queues import ReadyQueue
from shared.settings import Settings
from shared.store import Store
from shared.wiring import backends
from tests import alertmanager
from tests.integration.pipeline import pipeline


@pytest.fixture
async def queue(redis_url: str) -> AsyncIterator[ReadyQueue]:
    redis = Redis.from_url(redis_url)
    yield ReadyQueue(redis, 5.0)
    await redis.aclose()


async def _active(url: str, **labels: str) -> list[dict[str, Any]]:
    return [a for a in await alertmanager.alerts(url, **labels) if a["status"]["state"] == "active"]


async def _wait_for_alert(url: str, timeout: float = 10.0, **labels: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = await _active(url, **labels)
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)


# -- alerts --------------------------------------------------------------------------------------


async def test_extending_a_degrade_mode_keeps_its_alert_firing_until_the_new_until(
    store: Store, tmp_path: Path
) -> None:
    """An operator extends partial mode (partial for 2 s, then partial for an hour). The
    mode is in force for the hour, but SkedDegraded keeps the first change's endsAt: nothing
    is sent for a change to the same mode (shared/modes.alerts), so Alertmanager resolves the
    alert after 2 s while the scheduler stays degraded."""
    async with alertmanager.alertmanager(tmp_path / "am") as url:
        alerter = Alerter(None, url)
        try:
            await modes.change(store.degrade, Mode.PARTIAL, "short", "ann", 2.0, None, alerter)
            assert await _wait_for_alert(url, alertname="SkedDegraded")
            _, after = await modes.change(
                store.degrade, Mode.PARTIAL, "longer: GPU maintenance", "ann", 3600.0, None, alerter
            )
            assert after.effective() is Mode.PARTIAL
            await asyncio.sleep(3.5)  # past the first until, well inside the second
            state = await store.degrade.read()
            assert state.effective() is Mode.PARTIAL  # still degraded, for an hour
            firing = await _active(url, alertname="SkedDegraded")
            assert firing, "SkedDegraded resolved at the old until while partial mode holds"
            assert firing[0]["annotations"]["description"] == "longer: GPU maintenance"
        finally:
            await alerter.close()


async def test_lifting_full_mode_resolves_its_critical_alert(store: Store, tmp_path: Path) -> None:
    """Full mode fires SkedDegraded with severity "critical"; leaving it sends the resolve with
    severity "warning" (shared/modes.alerts hard-codes it). Severity is a label, so the
    resolve names another alert: the critical one keeps firing in Alertmanager until the old
    until (30 min for the automatic full mode; 5 min of resolve_timeout for one until
    lifted), after the operator lifted the mode, while a stray resolved warning appears."""
    async with alertmanager.alertmanager(tmp_path / "am") as url:
        alerter = Alerter(None, url)
        try:
            await modes.change(store.degrade, Mode.FULL, "incident", "ann", 1800.0, None, alerter)
            assert await _wait_for_alert(url, alertname="SkedDegraded", severity="critical")
            await modes.change(store.degrade, Mode.NORMAL, "over", "ann", None, None, alerter)
            deadline = time.monotonic() + 5
            while await _active(url, alertname="SkedDegraded"):
                assert time.monotonic() < deadline, (
                    "SkedDegraded{mode=full,severity=critical} still firing after the mode was "
                    f"lifted: {await _active(url, alertname='SkedDegraded')}"
                )
                await asyncio.sleep(0.2)
        finally:
            await alerter.close()


async def test_a_mode_until_lifted_keeps_its_alert_firing_past_alertmanagers_resolve_timeout(
    store: Store,
    settings: Settings,
    queue: ReadyQueue,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`sked degrade full` with no --for: SkedDegraded is sent once, without endsAt, and never
    again (nor by the evaluator, which runs every SKED_DEGRADE_CHECK_S). Alertmanager resolves
    an alert without endsAt that is not re-sent within its resolve_timeout (5 min by default;
    1 s here): the page goes quiet while nothing is dispatched. SkedNodeLost and the backlog
    alerts are sent the same way (services/scheduler/degrade.py, watch)."""
    monkeypatch.setattr(
        alertmanager, "CONFIG", "global:\n  resolve_timeout: 1s\n" + alertmanager.CONFIG
    )
    async with alertmanager.alertmanager(tmp_path / "am") as url:
        monkeypatch.setattr(degrade_service, "RESEND_S", 0.5)  # 60 s against 5 min
        alerter = Alerter(None, url)
        evaluator = Degrade(settings, store, queue, Hub(), None, alerter)
        try:
            await modes.change(store.degrade, Mode.FULL, "incident", "ann", None, None, alerter)
            assert await _wait_for_alert(url, alertname="SkedDegraded")
            for _ in range(8):  # the evaluator keeps running, as a scheduler's would
                await evaluator.evaluate()
                await asyncio.sleep(0.5)
            assert (await store.degrade.read()).effective() is Mode.FULL
            assert await _active(url, alertname="SkedDegraded"), (
                "SkedDegraded resolved by Alertmanager's resolve_timeout while full mode holds"
            )
        finally:
            await alerter.close()


# -- tracing -----------------------------------------------------------------------------------


async def test_a_traceparent_w3c_rejects_is_not_stored_and_the_task_keeps_one_trace(
    settings: Settings, store: Store, spans: InMemorySpanExporter
) -> None:
    """A producer sends `traceparent: 00-000…0-000…0-01` (the all-zero trace and span ids
    W3C calls invalid). shared/intake.py's pattern takes it, so it is stored as the task's
    trace context; OpenTelemetry refuses it on every extract, so no root is started at intake
    (the hook thinks the task has one) and every later span of the task starts a trace of its
    own: the task's trace is shattered, one trace per span."""
    bad = "00-" + "0" * 32 + "-" + "0" * 16 + "-01"
    body = json.dumps({"name": "hostile-trace", "job": {"kind": "command", "argv": ["true"]}})
    message_id = str(uuid4())
    async with backends(settings) as s:
        scheduler = Scheduler(settings, s.store, s.bus, s.ready_queue)
        running = asyncio.create_task(scheduler.run())
        producer = AmqpBus(settings.rabbitmq_url)
        try:
            await asyncio.wait_for(scheduler.ready.wait(), 30)
            await producer.connect()
            await producer.publish(
                TASKS_EXCHANGE,
                [
                    Outgoing(
                        SUBMIT_KEY,
                        body.encode(),
                        {SCHEMA_HEADER: 1, "traceparent": bad},
                        message_id=message_id,
                    )
                ],
            )
            deadline = time.monotonic() + 20
            while True:
                row = await store.pool.fetchrow(
                    "SELECT id, status, traceparent FROM tasks WHERE name = 'hostile-trace'"
                )
                if row is not None and row["status"] == State.READY.value:
                    break
                assert time.monotonic() < deadline, "the task was not admitted"
                await asyncio.sleep(0.1)
        finally:
            await producer.close()
            scheduler.stop()
            await asyncio.wait_for(running, 30)
    task_id = str(row["id"])
    mine = [
        sp
        for sp in spans.get_finished_spans()
        if sp.attributes and sp.attributes.get("sked.task_id") == task_id
    ]
    assert len(mine) >= 2, [sp.name for sp in mine]
    traces = {sp.context.trace_id for sp in mine}
    assert len(traces) == 1, f"the task's {len(mine)} spans fell into {len(traces)} traces"
    assert row["traceparent"] != bad, "a traceparent W3C calls invalid was stored unchecked"


# -- metrics -------------------------------------------------------------------------------------


def _moves(source: str, target: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value("sked_transitions_total", {"from": source, "to": target})
    return value or 0.0


async def test_a_refused_workflow_counts_no_transitions_that_were_rolled_back(
    store: Store,
) -> None:
    """A workflow whose task `b` names an id taken by a task outside it is refused whole, its
    transaction rolled back: nothing of it is written. But the transition hook ran inside the
    transaction, right after create_many, so sked_transitions_total counted task `a`'s
    Created -> Pending -> Ready (and tracing exported spans for them) for a task that never
    existed. A producer that knows (or picks) the message id can inflate the counter at will."""
    from shared import metrics, workflows
    from shared.dag import WorkflowSpec
    from shared.errors import InvalidSpec
    from shared.models import TaskSpec

    metrics.install()
    wf = uuid4()
    foreign = TaskSpec.parse({"name": "b", "job": {"kind": "command", "argv": ["true"]}})
    await store.tasks.create_many(
        [foreign], [workflows.task_id(wf, "b")], walk=(State.PENDING, State.READY)
    )
    spec = WorkflowSpec.parse(
        {
            "name": "w",
            "tasks": [
                {"name": "a", "command": ["true"]},
                {"name": "b", "command": ["true"]},
            ],
        }
    )
    before = (_moves("created", "pending"), _moves("pending", "ready"))
    for _ in range(5):
        with pytest.raises(InvalidSpec):
            await workflows.admit(store, wf, spec)
    after = (_moves("created", "pending"), _moves("pending", "ready"))
    rows = await store.pool.fetchval("SELECT count(*) FROM tasks WHERE workflow_id = $1", wf)
    assert rows == 0  # nothing of the workflow was written
    assert after == before, f"counted moves that were rolled back: {before} -> {after}"


# -- recovery under a flood of lost tasks, Alertmanager unreachable -----------------------------


@pytest.fixture
async def black_hole() -> AsyncIterator[str]:
    """An 'Alertmanager' on 127.0.0.1 that accepts connections and never answers (a hung
    server, or one behind a partition that drops replies)."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    for w in held:
        w.close()
    server.close()


async def test_a_flood_of_lost_tasks_is_not_held_up_by_an_unanswering_alertmanager(
    store: Store, settings: Settings, queue: ReadyQueue, black_hole: str
) -> None:
    """200 attempts are lost at once (a rack went away) while Alertmanager does not answer.
    Recovery moves them on 100 a pass and awaits each pass's SkedTaskLost post inline, up to
    its 5 s timeout: 10 s before the last is retried, and every other duty of the loop
    (stuck dispatches, the queue, the outbox) waits behind it. Alerting must not throttle
    recovery: the post should not be awaited in the loop's critical path (or be bounded
    far tighter / done in the background)."""
    from services.recovery.service import Recovery
    from shared import fsm
    from shared.relay import OutboxRelay
    from tests.helpers import spec

    n = 200
    admitted = await store.tasks.admit_many(
        [spec(f"t{i}", max_retries=1) for i in range(n)],
        [uuid4() for _ in range(n)],
        (State.PENDING, State.READY),
    )
    tasks = [t for t, _ in admitted]
    tasks = list(
        await store.tasks.transition_many(
            [fsm.plan(t, State.SCHEDULING, "placed", node="rack1") for t in tasks]
        )
    )
    owner = str(uuid4())
    tasks = list(
        await store.tasks.transition_many(
            [fsm.plan(t, State.RUNNING, "started", lease_owner=owner) for t in tasks]
        )
    )
    await store.tasks.transition_many(
        [fsm.plan(t, State.LOST, "rack1 gone", lease_owner=owner) for t in tasks]
    )
    alerter = Alerter(None, black_hole)
    recovery = Recovery(settings, store, queue, OutboxRelay(store, None, 1), alerter)  # type: ignore[arg-type]
    began = time.monotonic()
    try:
        recovered = 0
        while recovered < n:
            moved = await asyncio.wait_for(recovery.recover_lost(), 30)
            assert moved, "recovery stopped moving lost tasks"
            recovered += len(moved)
        took = time.monotonic() - began  # the posts go on in the background
    finally:
        await alerter.close()
    assert took < 3.0, f"{n} lost tasks took {took:.1f} s to recover behind Alertmanager"


async def test_span_attributes_from_an_attempts_error_are_bounded(
    settings: Settings, spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    """A command whose argv[0] is 130,000 characters cannot start; the shim's error names the
    program in full. The error stored with the task is clipped (2,000 characters,
    shared/outcome.storable), but the executor hands the raw error to the tracing hook, which
    sets it as `sked.error` on the attempt's span unclipped (OpenTelemetry has no attribute
    length limit by default): every such attempt exports a 130 KB span, up to the message
    size limit (1 MiB) a task spec may fill."""
    # under the 128 KiB a submission may give one argument (shared/execlimits.py)
    program = "/nonexistent/" + "x" * 130_000
    async with pipeline(settings, tmp_path, "traced") as (_, client):
        task_id = await client.submit(
            {"name": "long-argv", "job": {"kind": "command", "argv": [program]}, "max_retries": 0}
        )
        task = await client.wait(task_id, timeout=30)
    assert task.status is State.FAILED
    assert task.error is not None
    assert len(task.error) <= 2000  # the stored error is clipped
    sizes = {
        (sp.name, k): len(v)
        for sp in spans.get_finished_spans()
        for k, v in (sp.attributes or {}).items()
        if isinstance(v, str) and len(v) > 4096
    }
    assert not sizes, f"unbounded span attributes: {sizes}"


# -- degrade events ------------------------------------------------------------------------------


async def test_the_event_of_a_mode_ending_at_its_until_names_the_mode_that_ended(
    store: Store, settings: Settings, queue: ReadyQueue
) -> None:
    """Partial mode for 1 s; the evaluator ends it at its until ("an event of its own"). The
    `scheduler.degrade` event takes `previous` from the row's mode *in force*, which past the
    until is already normal: the event reads previous "normal" -> mode "normal", so a consumer
    of sked.events cannot tell that partial mode ended (nor that anything changed at all)."""
    import aio_pika

    from shared.bus import EVENTS_EXCHANGE

    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    conn = await aio_pika.connect(settings.rabbitmq_url)
    try:
        channel = await conn.channel()
        events = await channel.declare_queue("", exclusive=True)
        await events.bind(EVENTS_EXCHANGE, modes.DEGRADE_KEY)
        await modes.change(
            store.degrade, Mode.PARTIAL, "short window", "ann", 1.0, bus, Alerter(None, None)
        )
        await asyncio.sleep(1.3)
        evaluator = Degrade(settings, store, queue, Hub(), bus, Alerter(None, None))
        await evaluator.evaluate()
        assert (await store.degrade.read()).mode is Mode.NORMAL  # the evaluator ended it
        bodies: list[dict[str, Any]] = []
        deadline = time.monotonic() + 5
        while len(bodies) < 2 and time.monotonic() < deadline:
            message = await events.get(no_ack=True, fail=False)
            if message is None:
                await asyncio.sleep(0.05)
                continue
            bodies.append(json.loads(message.body))
    finally:
        await conn.close()
        await bus.close()
    assert [b["mode"] for b in bodies] == ["partial", "normal"], bodies
    ended = bodies[1]
    assert ended["previous"] == "partial", f"the ending event hides the mode it ended: {ended}"
