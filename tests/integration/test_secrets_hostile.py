"""Secrets in output, configuration trusted too much, observability that input could abuse:
each case was found by an adversarial review and once leaked a password or part of the
heartbeat secret, crashed or hung a process on a setting, let input forge a log line, or let
idle connections hold the heartbeat endpoint; each now holds."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.api.app import make_app
from services.api.service import BorrowedClient
from shared.bus import TASKS_EXCHANGE, Outgoing
from shared.errors import InvalidSettings
from shared.settings import Settings
from shared.wiring import backends

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "hunter2hunter2"
SECRET = "3f9c1e7a5b2d8046c1a9e3f7b5d20846e9a1c3f5b7d9e0a2c4e6f8a0b2d4f6a8"  # openssl rand -hex 32
FORGED = "2026-12-06 16:00:00,000 ERROR scheduler shared.runtime: FORGED LINE"


def _run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`sked ARGS` in a clean environment holding only PATH and `env`, bounded."""
    return _run_bounded(*args, timeout=60, **env)


def _run_bounded(*args: str, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    full = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _chunks(secret: str, size: int = 8) -> list[str]:
    return [secret[i : i + size] for i in range(0, len(secret) - size + 1)]


def _text_lines(records: list[logging.LogRecord]) -> list[str]:
    """The lines a service's text log (shared.runtime.configure_logging, SKED_LOG_JSON unset)
    holds for `records`: its own formatter, taken from the handler it installs (the root's
    handlers and level are put back at once, so caplog keeps capturing)."""
    from shared.runtime import configure_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging(Settings(log_json=False), "svc")
        formatter = root.handlers[0].formatter
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert formatter is not None
    return "\n".join(formatter.format(r) for r in records).splitlines()


# -- configuration -----------------------------------------------------------------------------


def test_a_refused_setting_does_not_print_part_of_the_heartbeat_secret() -> None:
    """SKED_NODE_FORGET_S below SKED_DEGRADE_NODES_SEEN_S is refused by a model validator:
    pydantic's message then shows the whole input dict, cut to its first and last ~25
    characters, i.e. the tail of SKED_HEARTBEAT_SECRET, to stderr (a container log)."""
    done = _run_cli(
        "service",
        "scheduler",
        SKED_DATABASE_URL=f"postgresql://sked:{PASSWORD}@127.0.0.1:1/sked",
        SKED_NODE_FORGET_S="10",
        SKED_HEARTBEAT_SECRET=SECRET,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    leaked = [c for c in _chunks(SECRET, 12) if c in out]
    assert not leaked, f"the heartbeat secret shows in the refusal: {out[-600:]}"


def test_an_invalid_setting_is_refused_with_its_variable_not_a_traceback() -> None:
    """SKED_SLOTS=-1: the service exits with one line naming SKED_SLOTS (it was a pydantic
    ValidationError traceback through pydantic-settings' internals, naming `slots`)."""
    done = _run_cli("service", "executor", SKED_SLOTS="-1", SKED_HEARTBEAT_SECRET=SECRET)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-800:]
    assert "SKED_SLOTS" in done.stderr, done.stderr[-800:]


def test_an_unknown_log_level_is_refused_as_a_setting() -> None:
    """SKED_LOG_LEVEL=verbose passes Settings (a plain str) and crashes configure_logging with
    `ValueError: Unknown level: 'VERBOSE'` and a traceback, not a refusal naming the variable."""
    done = _run_cli(
        "service",
        "relay",
        SKED_LOG_LEVEL="verbose",
        SKED_DATABASE_URL="postgresql://sked@127.0.0.1:1/sked",
        SKED_HEARTBEAT_SECRET=SECRET,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-800:]
    assert "SKED_LOG_LEVEL" in done.stderr, done.stderr[-800:]


def test_a_duration_past_what_postgres_adds_is_refused_naming_it() -> None:
    """SKED_NODE_TTL_S=1e300 passed Settings (gt=0, no upper bound) and reached Postgres as
    make_interval(secs => 1e300), which wraps to a negative interval: every read of the nodes
    then failed. Every `*_s` duration is bounded now, and a refusal names the variable."""
    with pytest.raises(InvalidSettings, match="SKED_NODE_TTL_S is over"):
        Settings(node_ttl_s=1e300, node_forget_s=0)
    with pytest.raises(InvalidSettings, match="SKED_STUCK_SCHEDULING_S"):
        Settings(stuck_scheduling_s=1e12)


def test_a_misspelt_rabbitmq_scheme_is_refused_not_retried_forever() -> None:
    """SKED_RABBITMQ_URL=ampq://guest:guest@127.0.0.1/vhost (amqp misspelt, no port given):
    aio-pika's robust connection meets KeyError: 'ampq' (no default port for that scheme) and
    retries every 5 s forever, so `sked submit` (and every service) hangs instead of saying
    which variable is wrong. Settings takes any string for the three URLs."""
    try:
        done = _run_bounded(
            "submit",
            "--command",
            "true",
            timeout=8,
            SKED_RABBITMQ_URL="ampq://guest:guest@127.0.0.1/sked_probe",
            SKED_DATABASE_URL="postgresql://sked@127.0.0.1:1/sked",
        )
    except subprocess.TimeoutExpired:
        pytest.fail("`sked submit` still runs after 8 s with SKED_RABBITMQ_URL=ampq://...")
    assert done.returncode == 2
    assert "SKED_RABBITMQ_URL" in done.stderr, done.stderr[-500:]


# -- CLI output --------------------------------------------------------------------------------


def test_sked_status_with_a_malformed_database_url_does_not_print_its_password() -> None:
    """`sked status ID` with an unparseable SKED_DATABASE_URL (an unclosed IPv6 bracket):
    libpq's refusal quotes the whole URI, password included; it is caught, but asyncpg then
    fails too and the chained traceback prints libpq's message to the terminal."""
    done = _run_cli(
        "status",
        "00000000-0000-0000-0000-000000000000",
        SKED_DATABASE_URL=f"postgresql://sked:{PASSWORD}@[::1/sked",
    )
    assert done.returncode != 0
    assert PASSWORD not in done.stdout + done.stderr, done.stderr[-800:]


def test_a_password_with_a_hash_does_not_reach_the_service_log() -> None:
    """A generated password holding '#' (or '/'), not percent-encoded:
    SKED_DATABASE_URL=postgresql://sked:s3cr#tpw@127.0.0.1:5432/sked. Settings takes it; at
    start urllib reads `sked:s3cr` as host:port and asyncpg raises `ValueError: invalid
    literal for int() with base 10: 's3cr'`, which run_main logs with log.exception("service
    failed"): the password's first part is in the service's log (what a log shipper keeps).
    The URL is checked at start, refused naming SKED_DATABASE_URL, never echoed."""
    done = _run_cli(
        "service",
        "relay",
        SKED_DATABASE_URL="postgresql://sked:s3cr#tpw@127.0.0.1:5432/sked",
        SKED_HEARTBEAT_SECRET=SECRET,
    )
    assert done.returncode != 0
    assert "s3cr" not in done.stdout + done.stderr, done.stderr[-400:]


# -- log forging -------------------------------------------------------------------------------


async def test_a_submission_cannot_forge_a_log_line_or_dead_letter_reason(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """A submission with an extra key holding a newline: intake refuses it (extra keys are
    forbidden) with `describe`, which joins pydantic's error location raw, so the key's text
    becomes a line of its own in the scheduler's text log and in x-sked-reason."""
    from services.scheduler.service import Scheduler

    body = json.dumps(
        {"name": "t", "job": {"kind": "command", "argv": ["true"]}, f"x\n{FORGED}": 1}
    ).encode()
    caplog.set_level(logging.WARNING)
    async with backends(settings) as b:
        scheduler = Scheduler(settings, b.store, b.bus, b.ready_queue)
        running = asyncio.create_task(scheduler.run())
        try:
            await asyncio.wait_for(scheduler.ready.wait(), 30)
            await b.bus.publish(TASKS_EXCHANGE, [Outgoing("submit", body)])
            dead: list[Any] = []
            for _ in range(100):
                dead = await b.bus.peek_dead(10)
                if dead:
                    break
                await asyncio.sleep(0.1)
        finally:
            scheduler.stop()
            await asyncio.wait_for(running, 30)
    assert dead, "the submission was not dead-lettered"
    refusing = [r for r in caplog.records if "dead-lettering" in r.getMessage()]
    assert refusing
    lines = _text_lines(refusing)
    assert not any(line.startswith(FORGED) for line in lines), lines
    assert "\n" not in dead[0].reason, dead[0].reason


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[TestClient[Any, Any]]:
    async with backends(settings) as b:
        app = make_app(settings, b.store, BorrowedClient(b))
        async with TestClient(TestServer(app)) as http:
            yield http


async def test_an_unauthenticated_request_cannot_forge_an_api_log_line(
    api: TestClient[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who can reach the API sends a made-up token to a path holding %0A: the path
    is logged decoded (ops.authenticate: "%s %s: unknown or revoked token"), so the text log
    gets a line of the caller's choosing."""
    caplog.set_level(logging.WARNING)
    forged = FORGED.replace(" ", "%20")
    async with api.get(f"/v1/tasks/x%0A{forged}", headers={"Authorization": "Bearer nope"}) as r:
        assert r.status == 401
    lines = _text_lines([r for r in caplog.records if r.name.startswith("services.api")])
    assert lines, "nothing logged"
    assert not any(line.startswith(FORGED) for line in lines), lines


async def test_a_task_name_cannot_forge_a_log_line_in_its_lost_alert(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer names a task `job\\n<a log line>` (TaskSpec.name takes any text up to 200
    characters). When its attempt is lost, recovery raises SkedTaskLost (lost_alert), whose
    summary holds the name; Alerter.send logs it as it is: the text log gets the forged line."""
    from datetime import UTC, datetime

    from services.recovery.service import lost_alert
    from shared.alerts import Alerter
    from tests.helpers import spec

    task = await store.tasks.create(spec(name=f"job\n{FORGED}"))
    caplog.set_level(logging.WARNING)
    await Alerter(None, None).send([lost_alert(task)], datetime.now(UTC))
    lines = _text_lines([r for r in caplog.records if r.name == "shared.alerts"])
    assert lines, "the alert was not logged"
    assert not any(line.startswith(FORGED) for line in lines), lines


# -- the heartbeat endpoint under connection abuse ----------------------------------------------


async def test_the_heartbeat_endpoint_holds_no_idle_or_slow_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every task's process can reach the heartbeat endpoint. aiohttp kept a connection that
    sent nothing for an hour and waited for a body without end, so a task holding connections
    could exhaust the monitor's files and leave every other task's beats unanswered (their
    attempts then judged lost). Now an idle connection is closed after IDLE_S and a body must
    arrive within BODY_S (both shortened here), and services raise their open-files limit."""
    from uuid import uuid4

    from services.heartbeat_monitor import http
    from services.heartbeat_monitor.beats import Beats

    monkeypatch.setattr(http, "IDLE_S", 0.5)
    monkeypatch.setattr(http, "BODY_S", 0.5)
    runner = http.runner(http.make_app(Beats(None), SECRET))  # type: ignore[arg-type]
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # sends nothing
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        writer.close()
        body = json.dumps({"task_id": str(uuid4()), "attempt": 1, "seq": 1}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(body)
            + body[:5]  # and the rest never
        )
        answer = await asyncio.wait_for(reader.read(200), 5)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        writer.close()
    finally:
        await runner.cleanup()


async def test_an_alertmanager_url_s_password_is_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SKED_ALERTMANAGER_URL=http://sked:PASSWORD@alertmanager:9093 is how basic auth reaches
    Alertmanager (aiohttp sends the URL's userinfo); when it cannot be reached, Alerter._post
    logs `Alertmanager not reached (<the URL>)`, password included."""
    from datetime import UTC, datetime

    from shared.alerts import Alert, Alerter

    caplog.set_level(logging.ERROR)
    alerter = Alerter(None, f"http://sked:{PASSWORD}@127.0.0.1:1")
    try:
        await alerter.send([Alert("SkedProbe", "warning", "probe")], datetime.now(UTC))
    finally:
        await alerter.close()
    said = [r.getMessage() for r in caplog.records if r.name == "shared.alerts"]
    assert said, "nothing logged"
    assert not any(PASSWORD in m for m in said), said
