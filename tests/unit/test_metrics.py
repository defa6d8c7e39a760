"""The metrics hook counts and times what the seams report, in Postgres time; /metrics is
served; `sked dev` gives each process a port of its own."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from services.dev import metrics_env
from shared import fsm, metrics
from shared.fsm import State
from shared.models import Task
from shared.settings import Settings
from shared.store import ClusterCounts
from tests.fakes.store import new_task
from tests.helpers import spec
from tests.servers import free_port

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def moved(task: Task, target: State, **fields: Any) -> tuple[Task, fsm.Move]:
    """A move of `task` to `target`, and the task as the CAS returned it (with `fields`)."""
    move = fsm.Move(task.id, task.version, task.status, target, "test")
    return replace(task, status=target, version=task.version + 1, **fields), move


def test_transitions_are_counted_and_timed_by_the_rows_timestamps() -> None:
    hook = metrics.MetricsHook()
    running = new_task(spec(), status=State.SCHEDULING, created_at=T0, queued_at=T0)
    start = moved(running, State.RUNNING, started_at=T0 + timedelta(seconds=3))
    task = start[0]
    end = moved(task, State.FAILED, finished_at=T0 + timedelta(seconds=10))
    retry = moved(end[0], State.RETRY_WAIT)
    before = {
        "moves": sample("sked_transitions_total", **{"from": "scheduling", "to": "running"}),
        "latency": sample("sked_task_start_latency_seconds_sum"),
        "le5": sample("sked_task_start_latency_seconds_bucket", le="5.0"),
        "run": sample("sked_task_run_seconds_sum", outcome="failed"),
        "retries": sample("sked_task_retries_total", **{"from": "failed"}),
        "lost": sample("sked_tasks_lost_total"),
    }
    hook.transitions([start], 0, 1)
    hook.transitions([end, retry], 0, 1)
    lost = moved(task, State.LOST)
    hook.transitions([lost], 0, 1)
    after = {
        "moves": sample("sked_transitions_total", **{"from": "scheduling", "to": "running"}),
        "latency": sample("sked_task_start_latency_seconds_sum"),
        "le5": sample("sked_task_start_latency_seconds_bucket", le="5.0"),
        "run": sample("sked_task_run_seconds_sum", outcome="failed"),
        "retries": sample("sked_task_retries_total", **{"from": "failed"}),
        "lost": sample("sked_tasks_lost_total"),
    }
    # approx: the process's histogram sums already hold other tests' observations
    assert {k: after[k] - before[k] for k in before} == pytest.approx(
        {
            "moves": 1,
            "latency": 3.0,  # queued_at -> started_at, both from the row
            "le5": 1,
            "run": 7.0,  # started_at -> finished_at
            "retries": 1,
            "lost": 1,
        }
    )


def test_counters_exist_at_zero_before_anything_happens() -> None:
    metrics.MetricsHook()
    for rule in fsm.TRANSITIONS:
        labels = {"from": rule.source.value, "to": rule.target.value}
        assert REGISTRY.get_sample_value("sked_transitions_total", labels) is not None
    for result in metrics.HEARTBEAT_RESULTS:
        assert REGISTRY.get_sample_value("sked_heartbeats_total", {"result": result}) is not None


def test_dispatch_passes_heartbeats_and_the_degrade_mode() -> None:
    hook = metrics.MetricsHook()
    placed = sample("sked_dispatch_pass_seconds_count", outcome="placed")
    idle = sample("sked_dispatch_pass_seconds_count", outcome="idle")
    hook.dispatch_pass(0.02, 5)
    hook.dispatch_pass(0.001, 0)
    assert sample("sked_dispatch_pass_seconds_count", outcome="placed") == placed + 1
    assert sample("sked_dispatch_pass_seconds_count", outcome="idle") == idle + 1
    refused = sample("sked_heartbeats_total", result="refused")
    hook.heartbeats("refused", 2)
    assert sample("sked_heartbeats_total", result="refused") == refused + 2
    dead = sample("sked_submissions_refused_total")
    hook.refused(3)
    assert sample("sked_submissions_refused_total") == dead + 3
    purged = sample("sked_tasks_purged_total")
    hook.purged(500)
    assert sample("sked_tasks_purged_total") == purged + 500
    for mode, rank in (("partial", 1), ("FULL", 2), ("normal", 0)):
        metrics.set_degrade_mode(mode)
        assert sample("sked_degrade_mode") == rank


def test_the_cluster_gauges_are_exported_only_by_the_elected_process() -> None:
    collector = metrics.ClusterCollector()
    assert list(collector.collect()) == []
    counts = ClusterCounts({"ready": 3}, outbox_backlog=7, relay_lag_s=1.5)
    collector.latest = (counts, {"ready": 3, "parked": 1, "resource": 0})
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }
    assert got[("sked_tasks", (("state", "ready"),))] == 3
    assert got[("sked_tasks", (("state", "running"),))] == 0
    assert got[("sked_ready_queue_depth", (("queue", "parked"),))] == 1
    assert got[("sked_outbox_backlog", ())] == 7
    assert got[("sked_relay_lag_seconds", ())] == 1.5


async def test_metrics_are_served_over_http_and_by_an_aiohttp_app() -> None:
    assert metrics.setup(Settings(metrics_port=-1), "relay") is None  # off by default
    port = metrics.setup(Settings(metrics_port=0), "relay")
    assert port
    app = web.Application()
    app.router.add_get("/metrics", metrics.aiohttp_handler())
    runner = web.AppRunner(app)
    await runner.setup()
    own = free_port()
    await web.TCPSite(runner, "127.0.0.1", own).start()
    try:
        async with aiohttp.ClientSession() as http:
            for url in (f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{own}/metrics"):
                async with http.get(url) as r:
                    text = await r.text()
                assert r.status == 200
                assert 'sked_transitions_total{from="ready",to="scheduling"}' in text
    finally:
        await runner.cleanup()


def test_sked_dev_gives_each_process_its_own_port() -> None:
    assert [metrics_env(9464, i)["SKED_METRICS_PORT"] for i in range(3)] == [
        "9464",
        "9465",
        "9466",
    ]
    assert metrics_env(0, 4) == {"SKED_METRICS_PORT": "0"}
    assert metrics_env(-1, 4) == {"SKED_METRICS_PORT": "-1"}
