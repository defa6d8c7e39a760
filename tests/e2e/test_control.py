"""Operator control end to end: pause, resume, cancel — with the processes really stopped."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import asyncpg

from shared.client import SkedClient
from shared.errors import NotFound
from shared.fsm import State
from shared.store import Tx
from shared.store.db import Db
from tests.e2e.checks import check_all_histories
from tests.e2e.conftest import Deployment
from tests.helpers import SKED, eventually


def sked(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SKED, *args], env=env, capture_output=True, text=True, timeout=60)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    # a zombie (state Z) is gone for our purposes: nothing runs any more
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def sleeper(name: str, pids: Path, first_attempt_sleeps: bool = True, **kw: Any) -> dict[str, Any]:
    """A command that records its pid per attempt and sleeps on attempt 1 (or always)."""
    cond = '[ "$SKED_ATTEMPT" = 1 ]' if first_attempt_sleeps else "true"
    script = f'echo "$SKED_ATTEMPT $$" >> {pids}; if {cond}; then exec sleep 60; fi'
    return {"name": name, "job": {"kind": "command", "argv": ["sh", "-c", script]}, **kw}


def recorded(pids: Path) -> dict[int, int]:
    """attempt -> pid, from the task's own output."""
    if not pids.exists():
        return {}
    out = {}
    for line in pids.read_text().split("\n"):
        if line.strip():
            attempt, pid = line.split()
            out[int(attempt)] = int(pid)
    return out


async def usage_is_zero(pool: asyncpg.Pool) -> bool:
    nodes = await Tx(Db(pool, 0.5), 10.0).nodes.all()
    return all(n.used_slots == 0 for n in nodes)


async def test_pause_stops_the_process_and_resume_runs_a_new_attempt(
    deployment: Deployment,
    client: SkedClient,
    service_env: dict[str, str],
    tmp_path: Path,
    pool: asyncpg.Pool,
) -> None:
    await deployment.start("scheduler")
    await deployment.executor("ctl", 2)
    pids = tmp_path / "pids"
    task_id = await client.submit(sleeper("pausable", pids, max_retries=1))

    async def started() -> int | None:
        return recorded(pids).get(1)

    pid = await eventually(started, timeout=30, what="attempt 1 to start")
    out = sked(service_env, "pause", str(task_id), "--reason", "maintenance", "--by", "alice")
    assert out.returncode == 0, out.stderr
    await eventually(lambda: _not_alive(pid), timeout=15, what="the paused process to stop")
    status = json.loads(sked(service_env, "status", str(task_id), "--json").stdout)
    assert status["status"] == "paused"
    assert (status["paused_by"], status["paused_reason"]) == ("alice", "maintenance")
    assert status["paused_at"]
    text = sked(service_env, "status", str(task_id)).stdout
    assert "by alice" in text
    assert "maintenance" in text
    await eventually(lambda: usage_is_zero(pool), timeout=15, what="the slot to be released")

    out = sked(service_env, "resume", str(task_id))
    assert out.returncode == 0, out.stderr
    task = await client.wait(task_id, timeout=30)
    assert task.status is State.SUCCESS
    assert (task.attempt, task.retry_count) == (2, 0)
    assert set(recorded(pids)) == {1, 2}
    await check_all_histories(pool)


async def _not_alive(pid: int) -> bool:
    return not alive(pid)


async def test_cancel_queued_and_running_tasks(
    deployment: Deployment,
    client: SkedClient,
    service_env: dict[str, str],
    tmp_path: Path,
    pool: asyncpg.Pool,
) -> None:
    # Lease renewals far apart (every 7.5 s: a quarter of the 30 s heartbeat timeout), so the
    # stop below can only come as soon as it does from the cancel's notification (the
    # executor listens on sked_taken), not from a renewal Postgres refuses.
    slow = {"SKED_NODE_HEARTBEAT_S": "20", "SKED_NODE_TTL_S": "60"}
    await deployment.start("scheduler", env=slow)
    await deployment.executor("one-slot", 1, env=slow)
    running_pids = tmp_path / "running"
    running = await client.submit(sleeper("running", running_pids, first_attempt_sleeps=False))
    pid = await eventually(
        lambda: _first_pid(running_pids), timeout=30, what="the running task to start"
    )
    queued_pids = tmp_path / "queued"
    queued = await client.submit(sleeper("queued", queued_pids))
    await eventually(lambda: _status_is(client, queued, State.READY), timeout=30, what="queued")

    out = sked(service_env, "cancel", str(queued), "--reason", "not needed")
    assert out.returncode == 0, out.stderr
    out = sked(service_env, "cancel", str(running))
    assert out.returncode == 0, out.stderr
    canceled_at = time.monotonic()
    await eventually(lambda: _not_alive(pid), timeout=15, what="the canceled process to stop")
    assert time.monotonic() - canceled_at < 5.0, "stopped by a renewal, not the notification"
    await eventually(lambda: usage_is_zero(pool), timeout=15, what="the reservation release")
    for task_id in (queued, running):
        task = await client.get(task_id)
        assert task.status is State.CANCELED
    assert "not needed" in (await client.get(queued)).status_reason
    assert not queued_pids.exists(), "a canceled queued task must never start"
    # the slot is free again: new work runs
    after = await client.submit({"name": "after", "job": {"kind": "command", "argv": ["true"]}})
    assert (await client.wait(after, timeout=30)).status is State.SUCCESS
    await check_all_histories(pool)


async def _first_pid(path: Path) -> int | None:
    return recorded(path).get(1)


async def _status_is(client: SkedClient, task_id: Any, state: State) -> bool:
    try:
        return (await client.get(task_id)).status is state
    except NotFound:  # its submission is still on its way
        return False


async def test_terminal_tasks_refuse_pause_and_cancel(
    deployment: Deployment, client: SkedClient, service_env: dict[str, str], pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler")
    await deployment.executor("t", 1)
    done = await client.submit({"name": "ok", "job": {"kind": "command", "argv": ["true"]}})
    before = await client.wait(done, timeout=30)
    events = len(await client.history(done))
    for args in (
        ("pause", str(done), "--reason", "x"),
        ("cancel", str(done)),
        ("resume", str(done)),
    ):
        out = sked(service_env, *args)
        assert out.returncode != 0
        assert "Success" in out.stderr, out.stderr
        assert "terminal" in out.stderr, out.stderr
    after = await client.get(done)
    assert (after.status, after.version) == (State.SUCCESS, before.version)
    assert len(await client.history(done)) == events
    missing = sked(service_env, "pause", "00000000-0000-0000-0000-000000000000", "--reason", "x")
    assert missing.returncode == 2
    assert "no task" in missing.stderr


async def test_a_task_paused_in_retry_wait_or_ready_never_starts_until_resumed(
    deployment: Deployment, client: SkedClient, tmp_path: Path, pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler")
    marker = tmp_path / "ran"
    retrying = await client.submit(
        {
            "name": "flaky",
            "job": {
                "kind": "command",
                "argv": ["sh", "-c", f'echo "$SKED_ATTEMPT" >> {marker}; [ "$SKED_ATTEMPT" != 1 ]'],
            },
            "max_retries": 3,
            "backoff_base_s": 2.0,
            "backoff_cap_s": 2.0,
        }
    )
    await deployment.executor("p", 2)
    await eventually(
        lambda: _status_is(client, retrying, State.RETRY_WAIT), timeout=30, what="RetryWait"
    )
    await client.pause(retrying, "hold the retry", by="bob")
    # a task paused while Ready (queued behind nothing: no executor can take it, selector)
    queued = await client.submit(
        {"name": "q", "job": {"kind": "command", "argv": ["true"]}, "selector": {"zone": "x"}}
    )
    await eventually(lambda: _status_is(client, queued, State.READY), timeout=30, what="Ready")
    await client.pause(queued, "hold", by="bob")
    await deployment.executor("zone-x", 1, "--label", "zone=x")
    # the backoff (1-2 s) passes and the zone-x node joins: neither paused task may start
    await eventually(lambda: _node_count(pool, 2), timeout=30, what="the zone-x node")
    retried = await _stays(lambda: _status_is(client, retrying, State.PAUSED), seconds=3.0)
    assert retried, "the paused RetryWait task moved"
    assert (await client.get(queued)).status is State.PAUSED
    assert marker.read_text().split() == ["1"]
    for task_id in (retrying, queued):
        await client.resume(task_id)
    done = await client.wait_all([retrying, queued], timeout=30)
    assert all(t.status is State.SUCCESS for t in done.values())
    assert done[retrying].retry_count == 1
    assert marker.read_text().split() == ["1", "2"]
    await check_all_histories(pool)


async def _node_count(pool: asyncpg.Pool, n: int) -> bool:
    return len(await Tx(Db(pool, 0.5), 10.0).nodes.all()) >= n


async def _stays(probe: Any, seconds: float) -> bool:
    """True if `probe` holds at every check for `seconds` (checks every 100 ms)."""
    import asyncio
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not await probe():
            return False
        await asyncio.sleep(0.1)
    return True
