"""Restart RabbitMQ, Redis (coming back empty) and Postgres in the middle of a run: work stalls,
then completes by itself — no task lost, none run twice.

These tests restart the machine's own servers, so they always restore them (bounded waits) and
must not run beside other tests that use the servers (the suite runs one test at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest

from shared.client import SkedClient
from shared.fsm import State
from tests.e2e.checks import check_all_histories
from tests.faults.checks import duplicated, overlap_s, read_stamps
from tests.faults.conftest import Deployment, Row
from tests.faults.jobs import stamp_specs, start_all
from tests.helpers import eventually


def port_open(port: int) -> bool:
    import socket

    with contextlib.closing(socket.socket()) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def run(*argv: str, timeout: float = 120) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=timeout)


async def wait_port(port: int, up: bool, timeout: float) -> None:
    async def check() -> bool:
        return port_open(port) == up

    await eventually(
        check, timeout=timeout, interval=0.2, what=f"port {port} {'up' if up else 'down'}"
    )


async def restart_rabbitmq() -> None:
    run("rabbitmqctl", "-q", "stop_app")
    try:
        await wait_port(5672, up=False, timeout=60)
        await asyncio.sleep(1.0)  # an outage, not a blip
    finally:
        run("rabbitmqctl", "-q", "start_app")
        await wait_port(5672, up=True, timeout=120)


REDIS_START = [
    "redis-server",
    "--daemonize",
    "yes",
    "--bind",
    "127.0.0.1",
    "-::1",
    "--port",
    "6379",
    "--save",
    "",
    "--appendonly",
    "no",
    "--dir",
    "/var/lib/redis",
    "--logfile",
    "/var/log/redis/ci.log",
]


async def restart_redis() -> None:
    """Shut Redis down without saving, so it comes back empty (its ready queue is gone)."""
    with contextlib.suppress(subprocess.CalledProcessError):
        run("redis-cli", "-p", "6379", "shutdown", "nosave")
    try:
        await wait_port(6379, up=False, timeout=30)
        await asyncio.sleep(1.0)
    finally:
        if not port_open(6379):
            run(*REDIS_START)
        await wait_port(6379, up=True, timeout=30)


def _pg_version() -> str:
    versions = sorted(Path(p).name for p in glob.glob("/etc/postgresql/*"))
    if not versions:
        pytest.fail("no /etc/postgresql cluster to restart")
    return versions[0]


async def restart_postgres() -> None:
    run("pg_ctlcluster", "--skip-systemctl-redirect", _pg_version(), "main", "stop", "-m", "fast")
    try:
        await wait_port(5432, up=False, timeout=60)
        await asyncio.sleep(1.0)
    finally:
        if not port_open(5432):
            run("pg_ctlcluster", "--skip-systemctl-redirect", _pg_version(), "main", "start")
        await wait_port(5432, up=True, timeout=60)


@pytest.fixture(autouse=True)
def _tools() -> None:
    for tool in ("rabbitmqctl", "redis-cli", "redis-server", "pg_ctlcluster"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not on PATH: outage tests restart the local servers")


async def outage_case(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
    name: str,
    restart: Callable[[], Awaitable[None]],
) -> None:
    await start_all(deployment, ["o1", "o2"], 6)
    # a heartbeat timeout long enough to ride out the outage without being declared lost
    specs = stamp_specs(
        stamps, 300, 40, heartbeat_timeout_s=30.0, max_retries=3, backoff_base_s=0.1
    )
    ids = await client.submit_many(specs)

    async def some_done() -> bool:
        return bool(await pool.fetchval("SELECT count(*) FROM tasks WHERE status = 'success'"))

    await eventually(some_done, timeout=60, what="work under way")
    started = time.monotonic()
    await restart()
    back = time.monotonic()
    await pool.expire_connections()  # the test's own connections died with Postgres, maybe
    done = await client.wait_all(ids, timeout=240)
    finished = time.monotonic()
    lost = sum(t.status is not State.SUCCESS for t in done.values())
    runs = read_stamps(stamps)
    dup = duplicated(runs)
    record.append(
        Row(f"restart {name} mid-run", len(ids), lost, dup, finished - back, overlap_s(runs))
    )
    print(f"\n{name}: outage {back - started:.1f} s; all done {finished - back:.1f} s after it")
    assert lost == 0
    assert dup == 0
    await check_all_histories(pool)
    # every service rode it out: none exited
    for proc in deployment.procs:
        assert proc.proc.poll() is None, f"{proc.name} exited during the outage:\n{proc.log()}"


async def test_restart_rabbitmq_mid_run(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
) -> None:
    await outage_case(deployment, client, pool, stamps, record, "RabbitMQ", restart_rabbitmq)


async def test_restart_redis_empty_mid_run(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
) -> None:
    await outage_case(
        deployment, client, pool, stamps, record, "Redis (empty after)", restart_redis
    )


async def test_restart_postgres_mid_run(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
) -> None:
    await outage_case(deployment, client, pool, stamps, record, "Postgres", restart_postgres)
