"""The test bed: throwaway databases cloned from a migrated template, per-test RabbitMQ vhosts.

Nothing here mocks Postgres, Redis or RabbitMQ: integration tests talk to the real local servers,
each in its own database / vhost / Redis database so that tests never see each other's data.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from urllib.parse import quote

import asyncpg
import pytest
from redis.asyncio import Redis

from shared.settings import Settings
from shared.store import Store
from shared.store.db import create_pool
from shared.store.migrate import migrate

PG_ADMIN = os.environ.get("SKED_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
PG_BASE = PG_ADMIN.rsplit("/", 1)[0]
AMQP_BASE = os.environ.get("SKED_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672")
REDIS_BASE = os.environ.get("SKED_TEST_REDIS", "redis://127.0.0.1:6379")

RUN = f"sked_t_{os.getpid()}"
TEST_SECRET = "test-heartbeat-secret-0123456789"
_counter = itertools.count(1)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _drop_databases(admin: asyncpg.Connection, names: list[str]) -> None:
    for name in names:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _stale_databases(admin: asyncpg.Connection) -> list[str]:
    """Databases left by earlier test runs whose process is gone (a killed run)."""
    rows = await admin.fetch("SELECT datname FROM pg_database WHERE datname LIKE 'sked_t_%'")
    stale = []
    for row in rows:
        parts = row["datname"].split("_")
        if len(parts) >= 3 and parts[2].isdigit() and not _pid_alive(int(parts[2])):
            stale.append(row["datname"])
    return stale


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    name = f"{RUN}_tmpl"

    async def setup() -> None:
        admin = await asyncpg.connect(PG_ADMIN)
        try:
            await _drop_databases(admin, [*await _stale_databases(admin), name])
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        await migrate(f"{PG_BASE}/{name}")

    async def teardown() -> None:
        admin = await asyncpg.connect(PG_ADMIN)
        try:
            rows = await admin.fetch(
                "SELECT datname FROM pg_database WHERE datname LIKE $1", f"{RUN}_%"
            )
            await _drop_databases(admin, [r["datname"] for r in rows])
        finally:
            await admin.close()

    asyncio.run(setup())
    yield name
    asyncio.run(teardown())


@pytest.fixture
async def dsn(template_db: str) -> AsyncIterator[str]:
    """A fresh, migrated database for this test only."""
    name = f"{RUN}_{next(_counter)}"
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    finally:
        await admin.close()
    yield f"{PG_BASE}/{name}"
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await _drop_databases(admin, [name])
    finally:
        await admin.close()


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(dsn, size=10)
    yield p
    await p.close()


@pytest.fixture
def store(pool: asyncpg.Pool, dsn: str) -> Store:
    """The store on this test's database (tests may also query `pool` directly)."""
    return Store(pool, dsn)


def _rabbitmqctl(*args: str) -> None:
    exe = shutil.which("rabbitmqctl")
    if exe is None:
        pytest.fail("rabbitmqctl is not on PATH: the test bed needs it to make vhosts")
    subprocess.run([exe, "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def amqp_url() -> Iterator[str]:
    """A RabbitMQ vhost of this test's own, so queues and exchanges never collide."""
    vhost = f"{RUN}_{next(_counter)}"
    _rabbitmqctl("add_vhost", vhost)
    _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    yield f"{AMQP_BASE}/{quote(vhost, safe='')}"
    _rabbitmqctl("delete_vhost", vhost)


@pytest.fixture
async def redis_url() -> AsyncIterator[str]:
    """A Redis database (1-13) of this test's own, emptied before use.

    Two test sessions may run at once (a developer's beside CI's), so a test holds its
    database by a key in database 0, set only if absent and expiring on its own should the
    session die; FLUSHDB touches only that database (never FLUSHALL on the shared server).
    """
    admin = Redis.from_url(f"{REDIS_BASE}/0")
    held = None
    try:
        first = next(_counter)
        for i in range(13 * 50):  # every database, 50 rounds: ~5 s of waiting at most
            db = 1 + (first + i) % 13  # 1-13; the benchmarks use 15
            if await admin.set(f"sked-test-redis-db:{db}", RUN, nx=True, ex=1800):
                held = f"sked-test-redis-db:{db}"
                break
            if db == 13:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("no Redis database 1-13 free: other test sessions hold them all")
        url = f"{REDIS_BASE}/{db}"
        client = Redis.from_url(url)
        try:
            await client.flushdb()
        finally:
            await client.aclose()
        yield url
    finally:
        if held is not None:
            await admin.delete(held)
        await admin.aclose()


@pytest.fixture
def settings(dsn: str, amqp_url: str, redis_url: str) -> Settings:
    return Settings(
        database_url=dsn,
        rabbitmq_url=amqp_url,
        redis_url=redis_url,
        heartbeat_secret=TEST_SECRET,
    )


@pytest.fixture
def service_env(settings: Settings) -> dict[str, str]:
    """The environment a service subprocess needs to join this test's deployment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKED_")}
    env.update(
        SKED_DATABASE_URL=settings.database_url,
        SKED_RABBITMQ_URL=settings.rabbitmq_url,
        SKED_REDIS_URL=settings.redis_url,
        SKED_HEARTBEAT_SECRET=settings.heartbeat_secret,
        PYTHONUNBUFFERED="1",
        # Small test clusters fill their few GPUs on purpose: the automatic GPU degrade
        # trigger (partial mode) would hold back their priority-0 tasks. Tests of the triggers
        # set their own thresholds (tests/integration/test_degrade.py).
        SKED_DEGRADE_GPU_RATIO="1",
    )
    return env


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the test item, so fixtures can tell a failed test."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
