"""Metrics end to end: every service serves /metrics, a real Prometheus scrapes them, and what
it holds agrees with Postgres — the transition counters, summed over the services, equal the
event rows of each (from, to) pair; the cluster-wide gauges come from one process only; every
expression of the shipped dashboard and alert rules is one Prometheus accepts, on series
that exist."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any
from uuid import uuid4

import aio_pika
import aiohttp
import asyncpg
import yaml

from shared.bus import SUBMIT_KEY, TASKS_EXCHANGE
from shared.client import SkedClient
from shared.fsm import State
from shared.settings import Settings
from tests.e2e.conftest import Deployment
from tests.helpers import ServiceProcess, eventually
from tests.servers import Prometheus, prometheus  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
METRICS = {"SKED_METRICS_PORT": "0", "SKED_METRICS_CLUSTER_S": "0.5"}
PORT = re.compile(r"metrics on http://[\d.]+:(\d+)/metrics")
MONITOR = re.compile(r"listening on (http://\S+/heartbeat)")

# a task's own process beats once with its attempt's token (services/executor/start.py)
BEAT = """
import json, os, urllib.request
body = json.dumps({"task_id": os.environ["SKED_TASK_ID"],
                   "attempt": int(os.environ["SKED_ATTEMPT"]), "seq": 1}).encode()
headers = {"Authorization": "Bearer " + os.environ["SKED_HEARTBEAT_TOKEN"]}
request = urllib.request.Request(os.environ["SKED_HEARTBEAT_URL"], body, headers)
print(urllib.request.urlopen(request, timeout=10).status)
"""

SERIES = [
    "sked_transitions_total",
    "sked_task_start_latency_seconds_count",
    "sked_task_run_seconds_count",
    "sked_tasks_lost_total",
    "sked_task_retries_total",
    "sked_dispatch_pass_seconds_count",
    "sked_ready_queue_depth",
    "sked_outbox_backlog",
    "sked_relay_lag_seconds",
    "sked_heartbeats_total",
    "sked_submissions_refused_total",
    "sked_tasks_purged_total",
    "sked_degrade_mode",
    "sked_tasks",
]


def metrics_port(proc: ServiceProcess) -> str:
    found = PORT.search(proc.log())
    assert found, f"{proc.name} logged no metrics port:\n{proc.log()}"
    return f"127.0.0.1:{found.group(1)}"


def value(result: list[dict[str, Any]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def specs() -> list[dict[str, Any]]:
    """100 tasks: 90 that succeed at once, 5 that beat once, 5 that fail and retry once."""
    out: list[dict[str, Any]] = [
        {"name": f"ok-{i}", "job": {"kind": "command", "argv": ["true"]}} for i in range(90)
    ]
    out += [
        {"name": f"beat-{i}", "job": {"kind": "command", "argv": [sys.executable, "-c", BEAT]}}
        for i in range(5)
    ]
    out += [
        {
            "name": f"fail-{i}",
            "job": {"kind": "command", "argv": ["false"]},
            "max_retries": 1,
            "backoff_base_s": 0.05,
        }
        for i in range(5)
    ]
    return out


async def event_pairs(dsn: str) -> dict[tuple[str, str], int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT from_status, to_status, count(*) AS n FROM task_events"
            " WHERE from_status IS NOT NULL GROUP BY 1, 2"
        )
    finally:
        await conn.close()
    return {(r["from_status"], r["to_status"]): int(r["n"]) for r in rows}


async def counted_pairs(prom: Prometheus) -> dict[tuple[str, str], int]:
    result = await prom.query("sum by (from, to) (sked_transitions_total)")
    pairs = {(r["metric"]["from"], r["metric"]["to"]): int(float(r["value"][1])) for r in result}
    return {pair: n for pair, n in pairs.items() if n}


def shipped_expressions() -> list[str]:
    """The PromQL of the Grafana dashboard's panels and of the alert rules."""
    board = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "sked.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", []) if "expr" in t]
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "sked-rules.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    # Grafana's own variables, as Grafana would fill them in
    return [e.replace("$__rate_interval", "1m").replace("$__range", "5m") for e in exprs]


async def test_prometheus_sees_what_postgres_recorded(
    deployment: Deployment,
    client: SkedClient,
    settings: Settings,
    prometheus: Prometheus,  # noqa: F811
) -> None:
    monitor = await deployment.start("heartbeat-monitor", "--port", "0", env=METRICS)
    found = MONITOR.search(monitor.log())
    assert found, monitor.log()
    beat_url = found.group(1)
    procs = {
        "scheduler": await deployment.start("scheduler", env=METRICS),
        "relay": await deployment.start("relay", env=METRICS),
        "heartbeat-monitor": monitor,
        "recovery": await deployment.start("recovery", env=METRICS),
        "executor": await deployment.executor(
            "m1", 8, env={**METRICS, "SKED_HEARTBEAT_URL": beat_url}
        ),
    }
    await prometheus.start({f"sked-{name}": [metrics_port(p)] for name, p in procs.items()})

    ids = await client.submit_many(specs())
    done = await client.wait_all(ids, timeout=90)
    ends = sorted(t.status.value for t in done.values())
    assert ends == ["failed"] * 5 + ["success"] * 95, ends
    async with (
        aiohttp.ClientSession() as http,
        http.post(beat_url, json={"task_id": str(ids[0]), "attempt": 1, "seq": 9}) as r,
    ):
        assert r.status == 401  # no token: refused
    # two submissions intake dead-letters, sent past the SDK (which would refuse them)
    connection = await aio_pika.connect(settings.rabbitmq_url)
    async with connection:
        exchange = await (await connection.channel()).get_exchange(TASKS_EXCHANGE)
        for body in (b"not json", b'{"name": "x"}'):
            await exchange.publish(aio_pika.Message(body, message_id=str(uuid4())), SUBMIT_KEY)

    # every transition's counter, summed over the services, equals its event rows
    events = await event_pairs(settings.database_url)

    async def agree() -> bool:
        return await counted_pairs(prometheus) == events

    await eventually(agree, timeout=30, interval=0.5, what="the counters to match the events")
    counted = await counted_pairs(prometheus)
    print(f"\ntransitions counted by Prometheus vs event rows in Postgres ({len(ids)} tasks):")  # noqa: T201
    for (src, dst), n in sorted(events.items()):
        print(f"  {src:>10} -> {dst:<11} prometheus {counted[src, dst]:>4}  postgres {n:>4}")  # noqa: T201
    assert counted == events

    for name in SERIES:
        # a cluster-wide gauge is absent for a scrape or two while its exporter changes hands
        # (the elected process gave its lock up after a failed read): look again a while
        async def present(name: str = name) -> bool:
            return bool(await prometheus.query(name))

        await eventually(present, timeout=15, interval=0.5, what=f"Prometheus to have {name}")

    async def gauge(expr: str) -> float:
        return value(await prometheus.query(expr))

    started = events[State.SCHEDULING.value, State.RUNNING.value]
    assert await gauge("sum(sked_task_start_latency_seconds_count)") == started
    ran = sum(n for (src, _), n in events.items() if src == State.RUNNING.value)
    assert await gauge("sum(sked_task_run_seconds_count)") == ran
    assert await gauge("sum(sked_task_retries_total)") == 5
    assert await gauge("sum(sked_tasks_lost_total)") == 0
    assert await gauge('sum(sked_heartbeats_total{result="accepted"})') >= 5
    assert await gauge('sum(sked_heartbeats_total{result="refused"})') >= 1

    async def both_refused() -> bool:
        return await gauge("sum(sked_submissions_refused_total)") == 2

    await eventually(both_refused, timeout=15, interval=0.5, what="two refusals counted")
    assert await gauge("sum(sked_dispatch_pass_seconds_count)") > 0
    assert await gauge("max(sked_degrade_mode)") == 0
    # cluster-wide gauges: one process exports them, and they say the work is done
    for name in ("sked_outbox_backlog", "sked_relay_lag_seconds"):
        assert await gauge(f"count(count by (job) ({name}))") == 1

    async def settled() -> bool:
        return await gauge("sum(sked_tasks)") == 0 and await gauge("sked_outbox_backlog") == 0

    await eventually(settled, timeout=15, interval=0.5, what="the cluster gauges to settle")
    assert await gauge('sum(sked_ready_queue_depth{queue="ready"})') == 0
    assert len(await prometheus.query("sked_tasks")) == 8  # one per state counted

    # the dashboard and the alert rules: valid PromQL, on series that exist
    known = await prometheus.names()
    for expr in shipped_expressions():
        await prometheus.query(expr)
        missing = {n for n in re.findall(r"\bsked_\w+", expr) if n not in known}
        assert not missing, f"{expr!r} names series that do not exist: {missing}"
