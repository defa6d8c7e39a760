"""Operator and observability paths against hostile or unlucky conditions: the metrics port
under idle connections, Alertmanager answering oddly (a non-UTF-8 error page, a redirect),
degrade changes racing the evaluator or shortened, an operator's lift against the triggers,
`sked degrade` without RabbitMQ, and a drain whose cordon is lifted meanwhile."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from uuid import uuid4

import asyncpg
import pytest
from aiohttp import web
from redis.asyncio import Redis

from services.scheduler.degrade import Degrade
from services.scheduler.hub import Hub
from shared import cordon, fsm, modes
from shared.alerts import Alerter
from shared.client import SkedClient
from shared.degrade import Mode
from shared.fsm import State
from shared.models import Task
from shared.queues import ReadyQueue
from shared.settings import Settings
from shared.store import Store
from tests import alertmanager
from tests.helpers import eventually, spec


@asynccontextmanager
async def fake_alertmanager(handler: web.Handler) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_an_alertmanager_error_page_not_in_utf8_does_not_fail_a_committed_degrade(
    store: Store, settings: Settings
) -> None:
    """A proxy in front of Alertmanager answering 502 with a Latin-1 error page once killed the
    alerter's poster (UnicodeDecodeError) and Alerter.close() re-raised it: `sked degrade`
    failed after the mode was committed. Now the body is decoded with replacement, anything
    else a post raises is logged, and close() never fails its caller."""

    async def bad_gateway(_: web.Request) -> web.Response:
        return web.Response(
            status=502, body="Passerelle défaillante".encode("latin-1"), content_type="text/html"
        )

    try:
        async with fake_alertmanager(bad_gateway) as url:
            s = settings.model_copy(update={"alertmanager_url": url})
            async with asyncio.timeout(30), SkedClient(s) as client:
                try:
                    state = await client.degrade(Mode.PARTIAL, "maintenance", "ann", 600)
                except UnicodeDecodeError as exc:
                    now = await store.degrade.read()
                    raise AssertionError(
                        f"degrade raised {exc!r} though the row says {now.mode.value} "
                        f"(version {now.version}): committed, yet reported as failed"
                    ) from exc
        assert state.mode is Mode.PARTIAL
    finally:
        gc.collect()  # the alerter's session close() never closed: warned about here


def test_idle_connections_to_the_metrics_port_do_not_each_pin_a_thread(
    settings: Settings,
) -> None:
    """The metrics server once took a thread per connection and kept it while the client said
    nothing: anyone who reached the port grew the process's threads without bound. Now at
    most metrics_port.MAX_CONNECTIONS are served at once (the rest closed at once), each
    request bounded by metrics_port.READ_TIMEOUT_S."""
    from shared import metrics

    s = settings.model_copy(update={"metrics_port": 0, "metrics_host": "127.0.0.1"})
    port = metrics.setup(s, "probe")
    assert port is not None
    before = threading.active_count()
    held: list[socket.socket] = []
    try:
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            held.append(c)
        time.sleep(2.0)
        grown = threading.active_count() - before
        assert grown < 50, f"{grown} threads held by 200 idle connections to /metrics"
    finally:
        for c in held:
            c.close()


async def _holder(store: Store, node: str) -> Task:
    (admitted,) = await store.tasks.admit_many(
        [spec("held")], [uuid4()], (State.PENDING, State.READY)
    )
    task = admitted[0]
    return await fsm.apply(store.tasks, task, State.SCHEDULING, node=node)


async def test_a_drain_whose_cordon_was_lifted_meanwhile_does_not_say_drained(
    store: Store,
) -> None:
    """Operator A drains n1; operator B uncordons it while the drain waits. The drain once
    answered drained (CLI exit 0, API 200) though the node took new work again; now it ends
    with Uncordoned (a NotAllowed: API 409, CLI exit 1), and says why."""
    await store.nodes.register("n1", 4, 2.0, 1024, 0, {}, uuid4())
    task = await _holder(store, "n1")
    async with asyncio.timeout(30):
        draining = asyncio.create_task(cordon.drain(store, "n1", "ann", timeout=10))
        await asyncio.sleep(0.3)
        await cordon.uncordon(store, "n1")  # operator B
        task = await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(uuid4()))
        await fsm.apply(store.tasks, task, State.SUCCESS)
        with pytest.raises(cordon.Uncordoned, match="uncordoned while the drain waited"):
            await draining


@pytest.fixture
async def queue(redis_url: str) -> AsyncIterator[ReadyQueue]:
    redis = Redis.from_url(redis_url)
    yield ReadyQueue(redis, 5.0)
    await redis.aclose()


async def test_a_shortened_mode_does_not_leave_its_alert_firing_after_it_ended(
    store: Store, settings: Settings, tmp_path: Path, queue: ReadyQueue
) -> None:
    """Partial for an hour, then partial for 2 s: Alertmanager keeps the later of two endsAt
    for one alert, and the end at its until sent no resolve, so SkedDegraded once fired for
    the hour. Now a shortened mode's alert is resolved before it fires again, and a mode left
    after its until is resolved too."""
    async with alertmanager.alertmanager(tmp_path / "am") as url:
        alerter = Alerter(None, url)
        s = settings.model_copy(update={"degrade_check_s": 0.2})
        evaluator = Degrade(s, store, queue, Hub(), None, alerter)
        try:
            async with asyncio.timeout(60):
                await modes.change(
                    store.degrade, Mode.PARTIAL, "upgrade", "ann", 3600, None, alerter
                )
                await alerter.flush()
                await eventually(
                    lambda: alertmanager.alerts(url, alertname="SkedDegraded"), what="firing"
                )
                await modes.change(store.degrade, Mode.PARTIAL, "short", "ann", 2, None, alerter)
                await alerter.flush()
                await asyncio.sleep(2.5)  # the mode's until has passed
                await evaluator.evaluate()  # writes "ended at its until"
                state = await store.degrade.read()
                assert state.mode is Mode.NORMAL
                await alerter.flush()
                deadline = time.monotonic() + 5
                firing = await alertmanager.alerts(url, alertname="SkedDegraded")
                while firing and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    firing = await alertmanager.alerts(url, alertname="SkedDegraded")
            assert not firing, "SkedDegraded still active in normal mode, until " + ", ".join(
                a["endsAt"] for a in firing
            )
        finally:
            await alerter.close()


async def test_an_alertmanager_url_that_redirects_does_not_swallow_alerts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An Alertmanager URL behind a 301 once had its POST followed as a GET, answered 200 with
    Alertmanager's list: alerts dropped, nothing logged. Now redirects are not followed, and
    one is logged as a refusal naming where it points."""
    posted: list[object] = []

    async def am(request: web.Request) -> web.Response:
        if request.path == "/api/v2/alerts":
            raise web.HTTPMovedPermanently("/real/api/v2/alerts")
        if request.method == "POST":
            posted.append(await request.json())
        return web.json_response([])  # Alertmanager's GET: the alerts it holds

    async with fake_alertmanager(am) as url:
        alerter = Alerter(None, url)
        try:
            async with asyncio.timeout(20):
                await alerter.send(
                    [modes._degraded(Mode.FULL, "rack down", datetime.now(UTC))],
                    datetime.now(UTC),
                )
                await alerter.flush()
        finally:
            await alerter.close()
    errors = [r for r in caplog.records if r.name == "shared.alerts" and r.levelname == "ERROR"]
    assert posted or errors, "the alert reached no Alertmanager, and no error was logged"


def _in_mode(store: Store, mode: Mode) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return (await store.degrade.read()).mode is mode

    return probe


class SlowBus:
    """RabbitMQ confirming slowly (a busy broker: publish() waits up to 10 s for confirms)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def publish(self, exchange: str, messages: object) -> None:
        await asyncio.sleep(self.delay_s)


async def test_an_operators_mode_is_not_contradicted_by_the_evaluators_late_alert(
    store: Store, settings: Settings, tmp_path: Path, queue: ReadyQueue
) -> None:
    """The evaluator commits automatic partial, then announces it while an operator sets full.
    Its alert, sent after a slow broker's event, once fired {mode=partial} again for its whole
    for_s in full mode. Now alerts go out before the event, announce re-reads the row (sends
    nothing for a superseded version) and the evaluator's resend follows the row as re-read,
    resolving every mode not in force (modes.degraded_alerts). Needs the evaluator to pass
    its store to modes.announce and resend modes.degraded_alerts (services/scheduler)."""
    admitted = await store.tasks.admit_many(
        [spec(f"t{i}") for i in range(3)], [uuid4() for _ in range(3)], (State.PENDING, State.READY)
    )
    assert len(admitted) == 3
    async with alertmanager.alertmanager(tmp_path / "am") as url:
        alerter = Alerter(None, url)
        s = settings.model_copy(update={"degrade_waiting": 2, "degrade_waiting_for_s": 600.0})
        evaluator = Degrade(s, store, queue, Hub(), SlowBus(2.0), alerter)  # type: ignore[arg-type]
        try:
            async with asyncio.timeout(60):
                evaluating = asyncio.create_task(evaluator.evaluate())
                await eventually(_in_mode(store, Mode.PARTIAL), what="partial committed")
                await modes.change(store.degrade, Mode.FULL, "rack down", "ann", 600, None, alerter)
                await evaluating
                await alerter.flush()
                await asyncio.sleep(1.0)
                state = await store.degrade.read()
                assert state.effective() is Mode.FULL
                partial = await alertmanager.alerts(url, alertname="SkedDegraded", mode="partial")
            assert not partial, (
                f"SkedDegraded{{mode=partial}} fires in full mode until {partial[0]['endsAt']}"
            )
        finally:
            await alerter.close()


async def test_an_operator_lifting_an_automatic_full_mode_is_not_overridden_at_once(
    store: Store, pool: asyncpg.Pool, settings: Settings, queue: ReadyQueue
) -> None:
    """Three of four nodes died for good (they count as seen for an hour); the evaluator enters
    full. The operator's `sked degrade off` once lasted one evaluation. Now an operator's lift
    holds the triggers back until its --for ends or, given none, for SKED_DEGRADE_CALM_S."""
    for name in ("n1", "n2", "n3", "n4"):
        await store.nodes.register(name, 4, 4.0, 1024, 0, {}, uuid4())
    await pool.execute(
        "UPDATE nodes SET heartbeat_at = now() - interval '60 seconds' WHERE id <> 'n1'"
    )
    evaluator = Degrade(settings, store, queue, Hub(), None, Alerter(None, None))
    await evaluator.evaluate()
    assert (await store.degrade.read()).mode is Mode.FULL
    await modes.change(
        store.degrade,
        Mode.NORMAL,
        "n2-n4 retired; run on n1",
        "ann",
        None,
        None,
        Alerter(None, None),
    )
    await evaluator.evaluate()
    after = await store.degrade.read()
    assert after.effective() is Mode.NORMAL, (
        f"the operator's lift lasted one evaluation: {after.mode.value} again ({after.reason})"
    )


async def test_an_operator_can_set_a_degrade_mode_while_rabbitmq_is_away(
    store: Store, settings: Settings
) -> None:
    """`sked degrade full` during a RabbitMQ outage once set nothing: SkedClient.degrade
    connected to RabbitMQ first. Now a RabbitMQ that cannot be reached is logged and the mode
    is set without its event (one that answers with a refusal is still an error)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # nothing listens there once closed
    away = settings.model_copy(
        update={"rabbitmq_url": f"amqp://guest:guest@127.0.0.1:{dead_port}/x"}
    )
    error: BaseException | None = None
    try:
        async with asyncio.timeout(60), SkedClient(away) as client:
            await client.degrade(Mode.FULL, "RabbitMQ down: hold back the flood", "ann", 600)
    except Exception as exc:
        error = exc
    state = await store.degrade.read()
    assert state.effective() is Mode.FULL, f"no mode set; degrade raised {error!r}"
