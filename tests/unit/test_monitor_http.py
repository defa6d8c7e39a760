"""The heartbeat-monitor's HTTP endpoint over loopback (no backing servers needed: beats are
coalesced in memory and only written by the flush, which these tests do not run): tokens,
bad bodies, coalescing, and visible shedding when too many attempts wait for a flush."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID, uuid4

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.heartbeat_monitor.beats import Beats
from services.heartbeat_monitor.http import make_app
from shared import heartbeat

SECRET = "test-secret-of-some-length"


@pytest.fixture
async def monitor() -> AsyncIterator[tuple[Beats, TestClient[Any, Any]]]:
    beats = Beats(None)  # type: ignore[arg-type]  # no flush runs: no store needed
    async with TestClient(TestServer(make_app(beats, SECRET))) as client:
        yield beats, client


async def beat(client: TestClient[Any, Any], task: UUID, seq: int, token: str | None = None) -> int:
    auth = token if token is not None else heartbeat.token(SECRET, task, 1)
    body = {"task_id": str(task), "attempt": 1, "seq": seq}
    async with client.post(
        "/heartbeat", json=body, headers={"Authorization": f"Bearer {auth}"}
    ) as r:
        return r.status


async def test_tokens_and_bodies(monitor: tuple[Beats, TestClient[Any, Any]]) -> None:
    mon, client = monitor
    task = uuid4()
    assert await beat(client, task, 1) == 202
    assert await beat(client, task, 2, token=heartbeat.token(SECRET, task, 2)) == 403  # attempt 2's
    assert await beat(client, task, 3, token=heartbeat.token("other", task, 1)) == 403
    async with client.post("/heartbeat", json={"task_id": str(task)}) as r:
        assert r.status == 401  # no bearer token
    headers = {"Authorization": f"Bearer {heartbeat.token(SECRET, task, 1)}"}
    async with client.post("/heartbeat", data=b"{not json", headers=headers) as r:
        assert r.status == 400
    # fields out of range are refused before anything is taken: never a crash in a flush
    for bad in (
        {"task_id": str(task), "attempt": 2**31, "seq": 1},
        {"task_id": str(task), "attempt": 1, "seq": 2**63},
        {"task_id": str(task), "attempt": -1, "seq": 1},
        {"task_id": str(task), "attempt": 1, "seq": -5},
        {"task_id": str(task), "attempt": 1, "seq": 1, "extra": 1},
    ):
        async with client.post("/heartbeat", json=bad, headers=headers) as r:
            assert r.status == 400, bad
    async with client.post(
        "/heartbeat", data=b'{"seq": ' + b"9" * 5000 + b"}", headers=headers
    ) as r:
        assert r.status == 400
    assert mon.stats["refused"] == 10
    assert mon.pending == {(task, 1): 1}


async def test_overload_is_shed_visibly(
    monitor: tuple[Beats, TestClient[Any, Any]],
) -> None:
    mon, client = monitor
    mon.max_pending = 3
    tasks = [uuid4() for _ in range(5)]
    statuses = [await beat(client, t, 1) for t in tasks]
    assert statuses == [202, 202, 202, 503, 503]  # a new attempt beyond the cap: 503
    assert await beat(client, tasks[0], 2) == 202  # one already waiting coalesces: accepted
    assert mon.stats["shed"] == 2
    assert mon.pending == {(t, 1): (2 if t == tasks[0] else 1) for t in tasks[:3]}
    async with client.get("/healthz") as r:
        health = await r.json()
    assert (health["shed"], health["pending"], health["received"]) == (2, 3, 6)
