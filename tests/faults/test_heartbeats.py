"""Heartbeats under fault: stale and forged beats, beats cut in transit, a flood of beats.

Real Postgres, RabbitMQ and Redis; every service a process of its own. The heartbeat-monitor
binds a free port (`--port 0`) and the tests talk to it over HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID, uuid4

import aio_pika
import aiohttp
import asyncpg

from shared import fsm, heartbeat
from shared.bus import HEARTBEATS_EXCHANGE
from shared.client import SkedClient
from shared.errors import NotFound
from shared.fsm import State
from shared.models import Task
from shared.settings import Settings
from shared.store import Store
from tests.e2e.checks import check_all_histories
from tests.faults.conftest import Deployment, Row
from tests.helpers import ServiceProcess, eventually, spec

FAST = {
    "SKED_NODE_HEARTBEAT_S": "0.5",  # executors beat twice a second
    "SKED_RECOVERY_PERIOD_S": "1",
    "SKED_PROBE_TIMEOUT_S": "1",
}
T = TypeVar("T")
HUGE = 10**15  # far above any seq an executor sends (milliseconds since the epoch, ~1.7e12)
LISTENING = re.compile(r"heartbeat-monitor listening on (http://127\.0\.0\.1:(\d+))/heartbeat")


@dataclass
class Monitor:
    """A heartbeat-monitor process and an HTTP client for it."""

    proc: ServiceProcess
    base: str
    http: aiohttp.ClientSession
    secret: str

    @property
    def url(self) -> str:
        return f"{self.base}/heartbeat"

    async def healthz(self) -> dict[str, int]:
        async with self.http.get(f"{self.base}/healthz") as resp:
            assert resp.status == 200, await resp.text()
            stats: dict[str, int] = await resp.json()
            return stats

    async def post(
        self, body: dict[str, Any] | bytes, token: str | None = None, *, auth: str | None = None
    ) -> int:
        """POST a beat; `token` is sent as a bearer token, `auth` as the raw header."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if auth is not None:
            headers["Authorization"] = auth
        data = body if isinstance(body, bytes) else _json(body)
        async with self.http.post(self.url, data=data, headers=headers) as resp:
            await resp.read()
            return resp.status

    async def beat(self, task_id: UUID, attempt: int, seq: int, token: str) -> int:
        return await self.post({"task_id": str(task_id), "attempt": attempt, "seq": seq}, token)

    def token(self, task_id: UUID, attempt: int) -> str:
        return heartbeat.token(self.secret, task_id, attempt)

    async def settled(self, what: str, **at_least: int) -> dict[str, int]:
        """Wait until the counters reached `at_least` and nothing is pending a flush."""

        async def probe() -> dict[str, int] | None:
            h = await self.healthz()
            if h["pending"] == 0 and all(h[k] >= v for k, v in at_least.items()):
                return h
            return None

        return await found(probe, timeout=15, what=what)


async def found(probe: Callable[[], Awaitable[T | None]], *, timeout: float, what: str) -> T:
    """`eventually` for a probe that returns the thing waited for, or None."""
    got = await eventually(probe, timeout=timeout, what=what)
    assert got is not None
    return got


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


async def start_monitor(
    deployment: Deployment, settings: Settings, http: aiohttp.ClientSession, env: dict[str, str]
) -> Monitor:
    proc = await deployment.start(
        "heartbeat-monitor",
        "--port",
        "0",
        env={**env, "SKED_HEARTBEAT_SECRET": settings.heartbeat_secret},
        ready="listening on",
    )
    found = LISTENING.search(proc.log())
    assert found, proc.log()
    return Monitor(proc, found.group(1), http, settings.heartbeat_secret)


def node_env(tmp_path: Path, node: str, **extra: str) -> dict[str, str]:
    """An executor's own state dir: never shared with another test run on this machine."""
    return {"SKED_STATE_DIR": str(tmp_path / f"state-{node}"), **extra}


async def publish_beats(settings: Settings, message: heartbeat.BeatMessage) -> None:
    """Publish a BeatMessage to `sked.heartbeats` as an executor would (confirmed)."""
    connection = await aio_pika.connect(settings.rabbitmq_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(HEARTBEATS_EXCHANGE)
        await exchange.publish(
            aio_pika.Message(message.model_dump_json().encode(), content_type="application/json"),
            routing_key="",
        )
    finally:
        await connection.close()


async def get_or_none(store: Store, task_id: UUID) -> Task | None:
    """The task, or None while the scheduler has not taken in its submission yet."""
    try:
        return await store.tasks.get(task_id)
    except NotFound:
        return None


async def lost_events(pool: asyncpg.Pool, ids: list[UUID]) -> list[asyncpg.Record]:
    rows: list[asyncpg.Record] = await pool.fetch(
        "SELECT task_id, at, reason FROM task_events "
        "WHERE to_status = 'lost' AND task_id = ANY($1::uuid[]) ORDER BY at",
        ids,
    )
    return rows


# -- 1 --------------------------------------------------------------------------------------


async def test_stale_heartbeats_change_nothing_and_bad_tokens_are_refused(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    store: Store,
    settings: Settings,
    tmp_path: Path,
    record: list[Row],
) -> None:
    # The executor's own beats are slowed to one an hour (and the scheduler keeps its node
    # placeable meanwhile), so the only beats the monitor sees are this test's: every counter
    # of /healthz can then be checked exactly, and hb_seq is never moved by anyone else.
    quiet = {"SKED_NODE_HEARTBEAT_S": "3600", "SKED_NODE_TTL_S": "7200"}
    await deployment.start("scheduler", env=quiet)
    async with aiohttp.ClientSession() as http:
        mon = await start_monitor(deployment, settings, http, quiet)
        await deployment.executor("fence", 2, env=node_env(tmp_path, "fence", **quiet))
        task_id = await client.submit(
            {
                "name": "fails-once-then-sleeps",
                "job": {
                    "kind": "command",
                    "argv": ["sh", "-c", '[ "$SKED_ATTEMPT" = 1 ] && exit 1; sleep 30'],
                },
                "max_retries": 1,
                "backoff_base_s": 0.05,
                "backoff_cap_s": 0.1,
                "heartbeat_timeout_s": 300,  # the ladder stays out of this test
            }
        )

        async def attempt_two_running() -> Task | None:
            t = await get_or_none(store, task_id)
            return t if t is not None and t.status is State.RUNNING and t.attempt == 2 else None

        before = await found(attempt_two_running, timeout=30, what="attempt 2 running")
        statuses = [(e.to_status, e.attempt) for e in await store.tasks.history(task_id)]
        assert (State.FAILED, 1) in statuses, statuses
        tok1, tok2 = mon.token(task_id, 1), mon.token(task_id, 2)
        h = await mon.healthz()
        assert h["received"] == h["applied"] == h["not_applied"] == h["pending"] == 0, h

        async def unchanged(what: str) -> Task:
            now = await store.tasks.get(task_id)
            assert now.status is State.RUNNING, what
            assert now.attempt == 2, what
            assert now.version == before.version, f"{what}: the task changed state"
            assert now.hb_seq == before.hb_seq, f"{what}: hb_seq {before.hb_seq}->{now.hb_seq}"
            assert now.hb_at == before.hb_at, what
            return now

        # warm-up: a valid beat of attempt 2 with seq 1000 is applied (so a later seq 1 is low)
        assert await mon.beat(task_id, 2, 1000, tok2) == 202
        h = await mon.settled("the warm-up beat flushed", applied=1)
        assert (h["received"], h["applied"], h["not_applied"]) == (1, 1, 0), h
        before = await store.tasks.get(task_id)
        assert before.hb_seq == 1000

        # (a) attempt 1's beats, with attempt 1's own valid token and a huge seq: accepted
        # (202), then not applied in the flush -- the attempt fence, in SQL
        for seq in (HUGE, HUGE + 1):
            assert await mon.beat(task_id, 1, seq, tok1) == 202
        h = await mon.settled("the stale-attempt beats flushed", not_applied=1)
        assert (h["received"], h["applied"], h["not_applied"]) == (3, 1, 1), h
        await unchanged("(a) stale attempt over HTTP")

        # ... and the same beats replayed over RabbitMQ, signed, from a node that does not exist
        ghost = heartbeat.NodeBeat(id="ghost", boot_id=uuid4(), load=0.0)
        await publish_beats(
            settings,
            heartbeat.BeatMessage(
                node=ghost,
                beats=[
                    heartbeat.SignedBeat(task_id=task_id, attempt=1, seq=HUGE, token=tok1),
                    heartbeat.SignedBeat(task_id=task_id, attempt=1, seq=HUGE + 1, token=tok1),
                ],
            ),
        )
        h = await mon.settled("the replayed bus beats flushed", received=5, not_applied=2)
        assert (h["received"], h["applied"], h["not_applied"]) == (5, 1, 2), h
        await unchanged("(a) stale attempt over the bus")

        # (b) attempt 2, right token, low seq: the seq fence
        assert await mon.beat(task_id, 2, 1, tok2) == 202
        h = await mon.settled("the low-seq beat flushed", not_applied=3)
        assert (h["received"], h["applied"], h["not_applied"]) == (6, 1, 3), h
        now = await unchanged("(b) low seq")
        assert now.hb_seq > 1

        # (c) refused before anything is taken
        body = {"task_id": str(task_id), "attempt": 2, "seq": HUGE}
        forbidden = [
            await mon.post(body, tok1),  # attempt 1's token for attempt 2
            await mon.post(body, "0" * 64),
            await mon.post(body, heartbeat.token("another-secret", task_id, 2)),
            await mon.post({**body, "task_id": str(uuid4())}, tok2),  # another task's token
        ]
        assert forbidden == [403] * 4
        unauthorized = [
            await mon.post(body),
            await mon.post(body, auth=f"Basic {tok2}"),
            await mon.post(body, auth=tok2),
        ]
        assert unauthorized == [401] * 3
        malformed = [
            await mon.post(b"not json", tok2),
            await mon.post(b"", tok2),
            await mon.post({"task_id": str(task_id), "attempt": 2}, tok2),  # no seq
            await mon.post({**body, "seq": 0}, tok2),
            await mon.post({**body, "attempt": "two"}, tok2),
            await mon.post({**body, "task_id": "not-a-uuid"}, tok2),
            await mon.post({**body, "node": "x"}, tok2),  # unknown field
        ]
        assert malformed == [400] * 7
        h = await mon.healthz()
        assert (h["received"], h["applied"], h["not_applied"], h["pending"]) == (6, 1, 3, 0), h
        assert h["refused"] == 14, h
        await unchanged("(c) refused beats")

        # (d) a valid attempt-2 beat with a huge seq is applied: the endpoint works
        assert await mon.beat(task_id, 2, HUGE, tok2) == 202
        h = await mon.settled("the valid beat flushed", applied=2)
        assert (h["received"], h["applied"], h["not_applied"]) == (7, 2, 3), h
        after = await store.tasks.get(task_id)
        assert after.hb_seq == HUGE
        assert (after.status, after.attempt, after.version) == (State.RUNNING, 2, before.version)
        assert after.hb_at is not None
        assert before.hb_at is not None
        assert after.hb_at > before.hb_at
        assert after.hb_deadline is not None
        # pushed a timeout past the beat, never pulled in
        assert (after.hb_deadline - after.hb_at).total_seconds() >= 300 - 1e-3

        # a bus replay of attempt 1 with a seq above even that changes nothing either
        await publish_beats(
            settings,
            heartbeat.BeatMessage(
                node=ghost,
                beats=[heartbeat.SignedBeat(task_id=task_id, attempt=1, seq=2 * HUGE, token=tok1)],
            ),
        )
        h = await mon.settled("the second bus replay flushed", received=8, not_applied=4)
        assert (h["received"], h["applied"], h["not_applied"]) == (8, 2, 4), h
        assert (await store.tasks.get(task_id)).hb_seq == HUGE

        # nor does a bus beat of attempt 2 signed with attempt 1's token or none of its own:
        # refused beat by beat before anything is taken
        forged = [
            heartbeat.SignedBeat(task_id=task_id, attempt=2, seq=3 * HUGE, token=tok)
            for tok in (tok1, "0" * 64, heartbeat.token("another-secret", task_id, 2))
        ]
        await publish_beats(settings, heartbeat.BeatMessage(node=ghost, beats=forged))
        h = await mon.settled("the forged bus beats refused", refused=17)
        assert (h["received"], h["applied"], h["refused"]) == (8, 2, 17), h
        assert (await store.tasks.get(task_id)).hb_seq == HUGE

        # lost: the task no longer Running in attempt 2 (a stale beat that moved it would
        # already have failed an assertion above)
        final = await store.tasks.get(task_id)
        lost = int(final.status is not State.RUNNING or final.attempt != 2)
        record.append(
            Row(
                "stale-attempt, low-seq and forged heartbeats (HTTP + bus)",
                1,
                lost,
                0,
                None,
            )
        )
        await client.cancel(task_id, reason="test over")
        executor = deployment.procs[-1]
        await executor.wait_for_log(f"stopped {task_id} attempt 2", timeout=20)
        assert (await store.tasks.get(task_id)).status is State.CANCELED
        assert "not applied (stale attempt or seq)" in mon.proc.log()
        assert "bad token" in mon.proc.log()
        await check_all_histories(pool)


# -- 3 --------------------------------------------------------------------------------------

TARGET_RATE = 10_000  # beats per second
FLOOD_S = 10.0
CONNECTIONS = 64


@dataclass
class Flood:
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0


async def flood(
    url: str, targets: list[tuple[bytes, dict[str, str]]], rate: float, seconds: float
) -> Flood:
    """POST beats round-robin over `targets` (body prefix, headers) at up to `rate` a second,
    for at most `seconds` and at most rate * seconds beats; seq increases with every beat."""
    out = Flood()
    cap = int(rate * seconds)
    numbers = itertools.count()
    connector = aiohttp.TCPConnector(limit=CONNECTIONS)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        start = time.monotonic()
        stop_at = start + seconds

        async def worker() -> None:
            while True:
                i = next(numbers)
                due = start + i / rate
                now = time.monotonic()
                if i >= cap or due >= stop_at or now >= stop_at:
                    return
                if due > now:
                    await asyncio.sleep(due - now)
                prefix, headers = targets[i % len(targets)]
                out.sent += 1
                t0 = time.perf_counter()
                try:
                    async with http.post(url, data=prefix + b"%d}" % (i + 1), headers=headers) as r:
                        await r.read()
                        out.statuses[r.status] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    out.errors[type(exc).__name__] += 1
                    continue
                out.latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(CONNECTIONS)))
        out.elapsed = time.monotonic() - start
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def test_a_flood_of_heartbeats(
    deployment: Deployment,
    pool: asyncpg.Pool,
    store: Store,
    settings: Settings,
    record: list[Row],
) -> None:
    async with aiohttp.ClientSession() as http:
        mon = await start_monitor(deployment, settings, http, {})
        pid = mon.proc.proc.pid
        rss_start = rss_mb(pid)

        # 195 tasks the flood keeps alive (timeout 5 s) and 5 it never beats, with deadlines
        # spread over the flood (timeouts 3..7 s); none has a node, so once overdue the ladder
        # marks them Lost at once (no executor to ask)
        kept = [spec(f"flooded-{i}", heartbeat_timeout_s=5) for i in range(195)]
        lapsing = [spec(f"lapsing-{i}", heartbeat_timeout_s=3 + i) for i in range(5)]
        tasks = await store.tasks.create_many([*kept, *lapsing], walk=[State.PENDING, State.READY])
        tasks = await store.tasks.transition_many([fsm.plan(t, State.SCHEDULING) for t in tasks])
        tasks = await store.tasks.transition_many(
            [fsm.plan(t, State.RUNNING, "started by the test") for t in tasks]
        )
        assert len(tasks) == 200
        assert all(t.status is State.RUNNING for t in tasks)
        kept_ids = [t.id for t in tasks[:195]]
        lapsing_tasks = tasks[195:]
        deadlines = {}
        for t in lapsing_tasks:
            assert t.hb_at is not None
            assert t.hb_deadline is not None
            # first looked at once the lease (the timeout) has run out by the margin
            expected = t.hb_at.timestamp() + t.heartbeat_timeout_s + store.lease_margin_s
            assert abs(t.hb_deadline.timestamp() - expected) < 1e-3
            deadlines[t.id] = t.hb_deadline
        targets = [
            (
                b'{"task_id":"%s","attempt":%d,"seq":' % (str(t.id).encode(), t.attempt),
                {
                    "Authorization": f"Bearer {mon.token(t.id, t.attempt)}",
                    "Content-Type": "application/json",
                },
            )
            for t in tasks[:195]
        ]
        h0 = await mon.healthz()

        samples: list[tuple[float, float]] = []
        flooding = asyncio.Event()

        async def sample_rss() -> None:
            t0 = time.monotonic()
            while not flooding.is_set():
                samples.append((time.monotonic() - t0, rss_mb(pid)))
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample_rss())
        cpu_before = cpu_s(pid)
        try:
            result = await flood(mon.url, targets, TARGET_RATE, FLOOD_S)
        finally:
            flooding.set()
            await sampler
        monitor_cpu = cpu_s(pid) - cpu_before
        flood_end = await pool.fetchval("SELECT now()")
        # right after the flood every kept task is still Running, its last beat applied lately
        lag = await pool.fetchrow(
            "SELECT count(*) FILTER (WHERE status = 'running') AS running, "
            "max(extract(epoch FROM now() - hb_at)) AS worst_age FROM tasks "
            "WHERE id = ANY($1::uuid[])",
            kept_ids,
        )
        answered = result.statuses[202] + result.statuses[503]
        h1 = await mon.settled("the flood flushed", received=h0["received"] + answered)

        async def all_lapsed() -> list[asyncpg.Record] | None:
            rows = await lost_events(pool, list(deadlines))
            return rows if len(rows) == len(deadlines) else None

        lapsed = await found(all_lapsed, timeout=30, what="the 5 unbeaten tasks marked Lost")
        rss_end = rss_mb(pid)

    kept_lost = [r for r in await lost_events(pool, kept_ids) if r["at"] <= flood_end]
    slack = {r["task_id"]: (r["at"] - deadlines[r["task_id"]]).total_seconds() for r in lapsed}
    rate = result.sent / result.elapsed
    ok_rate = result.statuses[202] / result.elapsed
    warm = [rss for t, rss in samples if t >= 1.0] or [samples[-1][1]]
    rss_warm, rss_peak = warm[0], max(rss for _, rss in samples)
    lat = sorted(result.latencies)
    p50 = statistics.median(lat) * 1000 if lat else float("nan")
    p99 = lat[int(len(lat) * 0.99)] * 1000 if lat else float("nan")
    received = h1["received"] - h0["received"]
    applied = h1["applied"] - h0["applied"]
    not_applied = h1["not_applied"] - h0["not_applied"]
    shed = h1["shed"] - h0["shed"]
    print(
        f"\nheartbeat flood: target {TARGET_RATE}/s for {FLOOD_S:g} s over {CONNECTIONS} "
        f"keep-alive connections; sent {result.sent} in {result.elapsed:.2f} s = {rate:.0f}/s "
        f"({ok_rate:.0f}/s accepted); answers {dict(result.statuses)}, client errors "
        f"{dict(result.errors)}; latency p50 {p50:.1f} ms, p99 {p99:.1f} ms\n"
        f"monitor /healthz: received {received}, applied {applied}, not applied {not_applied} "
        f"(beats coalesced per attempt per flush), shed {shed}, refused "
        f"{h1['refused'] - h0['refused']}; monitor CPU {monitor_cpu:.1f} s in "
        f"{result.elapsed:.1f} s ({100 * monitor_cpu / result.elapsed:.0f}% of a core)\n"
        f"monitor RSS: {rss_start:.1f} MB at start, {rss_warm:.1f} MB after 1 s of flood, peak "
        f"{rss_peak:.1f} MB, {rss_end:.1f} MB after; samples "
        f"{[round(r, 1) for _, r in samples]}\n"
        f"kept tasks at flood end: {lag['running']}/195 Running, oldest last beat "
        f"{float(lag['worst_age']):.2f} s ago\n"
        f"unbeaten tasks: Lost this long after their deadline (s): "
        f"{sorted(round(s, 3) for s in slack.values())}"
    )
    record.append(
        Row(
            f"heartbeat flood {rate:.0f}/s x {FLOOD_S:g} s, 5 of 200 lapse",
            200,
            len(kept_lost),
            0,
            max(slack.values()),
        )
    )
    assert result.sent > 0
    assert not result.errors, result.errors
    # every answered beat was counted; 503s and the shed counter agree
    assert received == answered, (received, answered)
    assert set(result.statuses) <= {202, 503}, result.statuses
    assert shed == result.statuses[503], (shed, result.statuses)
    assert applied > 0
    assert applied + not_applied <= received
    # the flood kept its 195 tasks alive, and was applied promptly
    assert lag["running"] == 195
    assert not kept_lost, kept_lost
    assert float(lag["worst_age"]) < 2.0
    # memory stayed bounded
    assert rss_peak < 2 * rss_warm, (rss_warm, rss_peak)
    assert rss_end < 2 * rss_warm, (rss_warm, rss_end)
    assert rss_peak < 300
    # and the unbeaten tasks were declared Lost no later than 1 s after their deadline
    assert all("gone" in r["reason"] for r in lapsed), [r["reason"] for r in lapsed]
    assert all(0 <= s <= 1.0 for s in slack.values()), slack
