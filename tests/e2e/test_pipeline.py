"""The pipeline end to end: scheduler, relay and executors as separate processes."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
from redis.asyncio import Redis

from shared.bus import DEAD_QUEUE, REASON_HEADER, SUBMIT_KEY, TASKS_EXCHANGE
from shared.client import SkedClient
from shared.fsm import State
from shared.settings import Settings
from tests.e2e.checks import check_all_histories, max_overlap
from tests.e2e.conftest import Deployment
from tests.helpers import SKED, eventually


def command(name: str, argv: list[str], **kw: Any) -> dict[str, Any]:
    return {"name": name, "job": {"kind": "command", "argv": argv}, **kw}


def handler(name: str, func: str, args: Any = None, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "job": {"kind": "handler", "handler": f"tests.e2e.jobs:{func}", "args": args},
        **kw,
    }


async def all_terminal(client: SkedClient, ids: list[Any], timeout: float) -> dict[Any, Any]:
    return await client.wait_all(ids, timeout=timeout)


async def test_mixed_tasks_reach_the_right_terminal_states(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("mix-1", 12)
    await deployment.executor("mix-2", 12)
    fast_retry = {"backoff_base_s": 0.05, "backoff_cap_s": 0.2}
    specs = (
        [command(f"true-{i}", ["true"]) for i in range(200)]
        + [command(f"false-{i}", ["false"], max_retries=2, **fast_retry) for i in range(100)]
        + [command(f"sleep-{i}", ["sleep", "30"], timeout_s=0.5) for i in range(50)]
        + [handler(f"h-{i}", "echo", {"value": i}) for i in range(150)]
    )
    ids = await client.submit_many(specs)
    done = await all_terminal(client, ids, timeout=180)
    by_name = {t.name: t for t in done.values()}
    for i in range(200):
        assert by_name[f"true-{i}"].status is State.SUCCESS
    for i in range(100):
        t = by_name[f"false-{i}"]
        assert (t.status, t.attempt, t.retry_count) == (State.FAILED, 3, 2), t
        assert t.error == "exit code 1"
    for i in range(50):
        t = by_name[f"sleep-{i}"]
        assert (t.status, t.attempt) == (State.TIMED_OUT, 1), t
    for i in range(150):
        t = by_name[f"h-{i}"]
        assert (t.status, t.result) == (State.SUCCESS, i), t
    events = await check_all_histories(pool)
    for i in range(100):
        attempts = [
            e["attempt"] for e in events[by_name[f"false-{i}"].id] if e["to_status"] == "running"
        ]
        assert attempts == [1, 2, 3]


async def test_two_schedulers_three_executors_two_thousand_tasks(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    for _ in range(2):
        await deployment.start("scheduler")
    await deployment.start("relay")
    slots = {"a": 4, "b": 6, "c": 8}
    for node, n in slots.items():
        await deployment.executor(node, n)
    ids = await client.submit_many([handler(f"t{i}", "nap", {"ms": 2}) for i in range(2000)])
    done = await all_terminal(client, ids, timeout=300)
    assert all(t.status is State.SUCCESS for t in done.values())
    events = await check_all_histories(pool)
    picks = Counter(
        e["task_id"] for evs in events.values() for e in evs if e["to_status"] == "scheduling"
    )
    assert set(picks.values()) == {1}, "a task was picked twice"
    assert all(t.attempt == 1 for t in done.values())
    for node, n in slots.items():
        intervals = [(t.started_at, t.finished_at) for t in done.values() if t.node == node]
        assert intervals, f"node {node} ran nothing"
        assert max_overlap(intervals) <= n, f"node {node} ran more than its {n} slots"
    # the schedulers shared the work
    logs = [p.log() for p in deployment.procs if p.name == "scheduler"]
    assert len(logs) == 2


async def test_priority_order_on_one_slot(deployment: Deployment, client: SkedClient) -> None:
    await deployment.start("scheduler")
    lows = await client.submit_many(
        [handler(f"low-{i}", "nap", {"ms": 5}, priority=0) for i in range(200)]
    )
    await eventually(lambda: _all_ready(client, lows), timeout=30, what="the lows to be queued")
    await deployment.executor("one", 1)

    async def some_started() -> bool:
        tasks = await (await client._db()).tasks.get_many(lows)
        return any(t.started_at for t in tasks)

    await eventually(some_started, timeout=30, what="the first lows to start")
    highs = await client.submit_many(
        [handler(f"high-{i}", "nap", {"ms": 5}, priority=10) for i in range(20)]
    )
    done = await all_terminal(client, lows + highs, timeout=120)
    order = sorted(done.values(), key=lambda t: t.started_at)
    first_high = next(i for i, t in enumerate(order) if t.priority == 10)
    # at most the one low already dispatched to the slot may start after the first high
    window = order[first_high : first_high + 21]
    assert sum(t.priority == 10 for t in window) == 20, [t.name for t in window]
    assert sum(t.priority == 0 for t in order[first_high:]) > 100, "the highs came too late"


async def _all_ready(client: SkedClient, ids: list[Any]) -> bool:
    tasks = await (await client._db()).tasks.get_many(ids)
    return len(tasks) == len(ids) and all(t.status is State.READY for t in tasks)


async def test_a_low_task_in_a_stream_of_highs_starts_within_the_aging_bound(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    aging_s = 0.05  # waiting 50 ms = +1 priority
    env = {"SKED_AGING_S": str(aging_s)}
    await deployment.start("scheduler", env=env)
    await deployment.executor("one", 1)
    stop = asyncio.Event()
    highs: list[Any] = []

    async def stream() -> None:
        # keep about ten highs queued ahead of the single slot for as long as the test runs:
        # the queue never empties, so without aging the low task would wait for the stream's end
        while not stop.is_set():
            queued = await pool.fetchval("SELECT count(*) FROM tasks WHERE status = 'ready'")
            if queued < 10:
                highs.extend(
                    await client.submit_many(
                        [
                            handler(f"high-{len(highs) + i}", "nap", {"ms": 20}, priority=10)
                            for i in range(10 - queued)
                        ]
                    )
                )
            await asyncio.sleep(0.05)

    streamer = asyncio.create_task(stream())
    try:

        async def streaming() -> bool:
            return len(highs) >= 30  # the slot has been busy with highs for a while

        await eventually(streaming, timeout=30, what="the stream of highs to get going")
        [low] = await client.submit_many([handler("low", "nap", {"ms": 1}, priority=0)])
        task = await client.wait(low, timeout=30)
        assert task.queued_at is not None

        async def past_its_window() -> bool:
            # stream on until highs were queued after the low's window closed (bound below):
            # a fast node may start the low before any such high is queued
            after = task.queued_at + timedelta(seconds=(10 - 0) * aging_s + 0.2)
            return bool(
                await pool.fetchval(
                    "SELECT count(*) FROM tasks WHERE name LIKE 'high-%' AND queued_at > $1",
                    after,
                )
            )

        await eventually(past_its_window, timeout=10, what="highs queued past the low's window")
    finally:
        stop.set()
        await streamer
    bound = (10 - 0) * aging_s  # docs/architecture.md: (P - p) * aging_s, plus the backlog
    waited = (task.started_at - task.queued_at).total_seconds()
    # plus the backlog ahead of it when its window closed: about ten 20 ms tasks; allow 1 s
    assert waited <= bound + 1.0, f"waited {waited:.2f} s, bound {bound:.2f} s + backlog"
    later = [
        t
        for t in (await client.wait_all(highs, timeout=60)).values()
        if t.queued_at > task.queued_at + timedelta(seconds=bound + 0.2)
    ]
    assert later, "the stream ended too early to show aging"
    assert all(t.started_at > task.started_at for t in later), (
        "highs queued well after the low's window still went first"
    )


async def test_bad_submissions_are_dead_lettered_and_nothing_else_is_lost(
    deployment: Deployment, client: SkedClient, settings: Settings
) -> None:
    await deployment.start("scheduler")
    await deployment.executor("dl", 2)
    connection = await aio_pika.connect_robust(settings.rabbitmq_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(TASKS_EXCHANGE)
        bad = {
            "malformed": b"{this is not json",
            "missing field": json.dumps({"job": {"kind": "command", "argv": ["true"]}}).encode(),
            "wrong type": json.dumps(
                {"name": "x", "job": {"kind": "command", "argv": ["true"]}, "priority": "high"}
            ).encode(),
            "huge": b'{"name": "' + b"x" * (10 * 1024 * 1024) + b'"}',
        }
        for body in bad.values():
            await exchange.publish(
                aio_pika.Message(body, content_type="application/json"), routing_key=SUBMIT_KEY
            )
        good = await client.submit(command("after-the-bad", ["true"]))
        assert (await client.wait(good, timeout=30)).status is State.SUCCESS
        dead = await channel.get_queue(DEAD_QUEUE)
        reasons = []
        for _ in range(len(bad)):
            message = await dead.get(timeout=10)
            assert message is not None
            reasons.append(str(message.headers[REASON_HEADER]))
            await message.ack()
    assert any("malformed JSON" in r for r in reasons), reasons
    assert any("name: Field required" in r for r in reasons), reasons
    assert any("priority" in r and "integer" in r for r in reasons), reasons
    assert any("exceeds the limit" in r for r in reasons), reasons
    assert (await client.get(good)).status is State.SUCCESS


async def test_redis_loss_rebuilds_the_ready_queue(
    deployment: Deployment, client: SkedClient, settings: Settings
) -> None:
    scheduler = await deployment.start("scheduler")
    ids = await client.submit_many([handler(f"r{i}", "noop") for i in range(1000)])
    await eventually(lambda: _all_ready(client, ids), timeout=60, what="1,000 Ready tasks")
    scheduler.stop()
    redis = Redis.from_url(settings.redis_url)
    try:
        # no node yet: they wait parked (no node can take them) or in line
        assert await redis.zcard("sked:ready") + await redis.zcard("sked:parked") == 1000
        await redis.flushall()
    finally:
        await redis.aclose()
    await deployment.start("scheduler")
    await deployment.executor("after-flush", 8)
    done = await all_terminal(client, ids, timeout=120)
    assert all(t.status is State.SUCCESS for t in done.values())


async def test_readme_quickstart_dev_and_cli(service_env: dict[str, str], tmp_path: Path) -> None:
    """`sked dev` runs the stack; `sked submit --wait`, status, events, logs, nodes, wait work."""
    log = (tmp_path / "dev.log").open("wb")
    dev = subprocess.Popen(
        [SKED, "dev", "--executors", "2", "--slots", "2"],
        env=service_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        async def up() -> bool:
            text = (tmp_path / "dev.log").read_text()
            return text.count("ready:") >= 2 and "scheduler consuming" in text

        await eventually(up, timeout=60, what="sked dev to start")

        def sked(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [SKED, *args], env=service_env, capture_output=True, text=True, timeout=60
            )

        out = sked("submit", "--command", "sh -c 'echo hello from sked'", "--wait", "--json")
        assert out.returncode == 0, out
        task = json.loads(out.stdout)
        assert task["status"] == "success"
        assert sked("logs", task["id"]).stdout.strip() == "hello from sked"
        status = sked("status", task["id"])
        assert "Success" in status.stdout
        events = json.loads(sked("events", task["id"], "--json").stdout)
        assert [e["to_status"] for e in events][-1] == "success"
        nodes = json.loads(sked("nodes", "--json").stdout)
        assert {n["id"] for n in nodes} == {"dev-1", "dev-2"}
        failing = sked("submit", "--command", "false").stdout.strip()
        assert sked("wait", failing, "--timeout", "30").returncode == 1
        listed = json.loads(sked("list", "--status", "Failed", "--json").stdout)
        assert [t["id"] for t in listed] == [failing]
        bad = sked("submit", "--handler", "not a handler")
        assert bad.returncode == 2
        assert "handler" in bad.stderr
    finally:
        dev.send_signal(signal.SIGINT)
        try:
            code = dev.wait(timeout=30)
        except subprocess.TimeoutExpired:
            dev.kill()
            code = dev.wait(timeout=10)
        log.close()
    assert code == 0, (tmp_path / "dev.log").read_text()
    assert "stopping" in (tmp_path / "dev.log").read_text()
