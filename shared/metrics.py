"""Prometheus metrics: a hook on sked's seams (shared/hooks.py), as tracing is one, and the
cluster-wide gauges that one process per deployment computes. Each process serves them on
GET /metrics at SKED_METRICS_PORT (off by default; README, "Configuration").

Counted by each process for what it did (sum over processes and replicas):

  sked_transitions_total{from,to}        state changes made (CAS winners)
  sked_task_start_latency_seconds        runnable (queued_at) -> attempt started (started_at)
  sked_task_run_seconds{outcome}         attempt started -> ended (finished_at), by end state
  sked_tasks_lost_total                  attempts declared Lost
  sked_task_retries_total{from}          retries spent (moves into RetryWait), by state left
  sked_dispatch_pass_seconds{outcome}    one dispatch pass (outcome: placed, idle)
  sked_heartbeats_total{result}          task heartbeats accepted, refused, shed or stale
  sked_submissions_refused_total         submissions intake dead-lettered
  sked_tasks_purged_total                finished tasks retention deleted
  sked_degrade_mode                      the mode this scheduler dispatches in (0, 1, 2)

Every time is a Postgres timestamp carried on the task row, never this host's clock, so a
skewed host cannot bend a latency. Counters start at 0 in every process (rate() sees their
first increment).

Cluster-wide, computed ONCE per deployment:

  sked_tasks{state}                      tasks in each state work passes through
  sked_outbox_backlog                    events not yet published
  sked_relay_lag_seconds                 age of the oldest of them (Postgres clock)
  sked_ready_queue_depth{queue}          the Redis ready queue: ready, parked, resource, fenced

Why once: these are facts about the shared Postgres and Redis, not about a process. Were
every replica to query them on every scrape, the load would grow with replicas x scrapers,
and sum() over replicas would count each task once per replica. So the processes with metrics
on elect one — whichever holds a session-level Postgres advisory lock (shared/store/gauges.py)
— to query them every SKED_METRICS_CLUSTER_S; only that process exports them. It dies or
loses its connection: the lock is released with the session, and another process takes it at
its next try. Query them with sum() or max(): one series each, whichever process it is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared import hooks
from shared.errors import one_line
from shared.fsm import TRANSITIONS, State
from shared.metrics_port import serve

if TYPE_CHECKING:
    from aiohttp import web

    from shared.fsm import Move
    from shared.models import Task
    from shared.queues import ReadyQueue
    from shared.settings import Settings
    from shared.store import ClusterCounts, ClusterGauges, Store

log = logging.getLogger(__name__)

# latencies from a few ms (a warm pipeline) to an hour (a backlog); runs up to a day
START_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
RUN_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800, 3600, 3 * 3600, 6 * 3600, 86400)
PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

MOVES = Counter(
    "sked_transitions_total",
    "Task state changes this process made (CAS winners), by from and to state.",
    ["from", "to"],
)
START_LATENCY = Histogram(
    "sked_task_start_latency_seconds",
    "From a task becoming runnable (queued_at: its submission, its workflow release or the end "
    "of its retry backoff) to its attempt's start (started_at), in Postgres time.",
    buckets=START_BUCKETS,
)
RUN = Histogram(
    "sked_task_run_seconds",
    "An attempt's run, from started_at to finished_at (Postgres time), by the state it ended in.",
    ["outcome"],
    buckets=RUN_BUCKETS,
)
LOST = Counter("sked_tasks_lost_total", "Attempts declared Lost (Running -> Lost).")
RETRIES = Counter(
    "sked_task_retries_total",
    "Retries spent (moves into RetryWait), by the state retried from.",
    ["from"],
)
DISPATCH_PASS = Histogram(
    "sked_dispatch_pass_seconds",
    "One dispatch pass of this scheduler: placed (it placed tasks) or idle.",
    ["outcome"],
    buckets=PASS_BUCKETS,
)
HEARTBEATS = Counter(
    "sked_heartbeats_total",
    "Task heartbeats: accepted, refused (no or bad token, bad body), shed (overload), or "
    "stale (accepted, but the attempt had moved on when written; one per attempt per flush).",
    ["result"],
)
REFUSED = Counter(
    "sked_submissions_refused_total",
    "Submissions intake dead-lettered to sked.dead (each with its reason in x-sked-reason): "
    "invalid, unsafe, over the size limit, refused by policy, or a key's conflicting spec.",
)
PURGED = Counter(
    "sked_tasks_purged_total",
    "Finished tasks deleted with their history by retention (SKED_RETENTION_DAYS), a "
    "workflow's tasks included.",
)
DEGRADE = Gauge(
    "sked_degrade_mode",
    "The degrade mode this scheduler dispatches in: 0 normal, 1 partial, 2 full.",
)

DEGRADE_RANKS = {"normal": 0, "partial": 1, "full": 2}
RUN_ENDS = frozenset({State.SUCCESS, State.FAILED, State.TIMED_OUT, State.CANCELED})
HEARTBEAT_RESULTS = ("accepted", "refused", "shed", "stale")
# the states sked_tasks counts: every state but the final ones (success, failed, timed_out,
# canceled, skipped), whose counts only grow and would cost a scan of the table each time
CLUSTER_STATES = tuple(
    s.value
    for s in (
        State.CREATED,
        State.PENDING,
        State.READY,
        State.SCHEDULING,
        State.RUNNING,
        State.RETRY_WAIT,
        State.LOST,
        State.PAUSED,
    )
)
QUEUES = ("ready", "parked", "resource", "fenced")


def set_degrade_mode(mode: str) -> None:
    """The degrade mode this scheduler now dispatches in: normal, partial or full."""
    DEGRADE.set(DEGRADE_RANKS[str(mode).lower()])


class MetricsHook(hooks.Hook):
    """Counts and times at sked's seams. Label children are looked up once and kept: the
    transition hook runs after every CAS, for batches of hundreds of tasks."""

    def __init__(self) -> None:
        self._moves: dict[tuple[State, State], Any] = {}
        self._runs: dict[State, Any] = {}
        self._retries: dict[State, Any] = {}
        for rule in TRANSITIONS:
            self._move(rule.source, rule.target)
            if rule.target is State.RETRY_WAIT:
                self._retry(rule.source)
        for result in HEARTBEAT_RESULTS:
            HEARTBEATS.labels(result)

    def _move(self, source: State, target: State) -> Any:
        child = self._moves.get((source, target))
        if child is None:
            child = self._moves[source, target] = MOVES.labels(source.value, target.value)
        return child

    def _retry(self, source: State) -> Any:
        child = self._retries.get(source)
        if child is None:
            child = self._retries[source] = RETRIES.labels(source.value)
        return child

    def transitions(self, moved: Sequence[tuple[Task, Move]], start_ns: int, end_ns: int) -> None:
        for task, move in moved:
            source, target = move.source, move.target
            self._move(source, target).inc()
            started, ended = task.started_at, task.finished_at
            if target is State.RUNNING and started is not None:
                since = task.queued_at or task.created_at
                START_LATENCY.observe(max((started - since).total_seconds(), 0.0))
            elif source is State.RUNNING and target in RUN_ENDS and started and ended:
                run = self._runs.get(target)
                if run is None:
                    run = self._runs[target] = RUN.labels(target.value)
                run.observe(max((ended - started).total_seconds(), 0.0))
            if target is State.LOST:
                LOST.inc()
            elif target is State.RETRY_WAIT:
                self._retry(source).inc()

    def dispatch_pass(self, seconds: float, placed: int) -> None:
        DISPATCH_PASS.labels("placed" if placed else "idle").observe(seconds)

    def heartbeats(self, result: str, n: int) -> None:
        HEARTBEATS.labels(result).inc(n)

    def refused(self, n: int) -> None:
        REFUSED.inc(n)

    def purged(self, n: int) -> None:
        PURGED.inc(n)


class ClusterCollector(Collector):
    """Exports the cluster-wide gauges while this process is the one elected to compute them
    (nothing otherwise): the last values read, set by `cluster`'s loop."""

    def __init__(self) -> None:
        self.latest: tuple[ClusterCounts, dict[str, int]] | None = None

    def describe(self) -> Iterator[Metric]:
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        latest = self.latest
        if latest is not None:
            yield from self._families(latest)

    @staticmethod
    def _families(latest: tuple[ClusterCounts, dict[str, int]] | None) -> Iterator[Metric]:
        tasks = GaugeMetricFamily(
            "sked_tasks",
            "Tasks in each state work passes through (final states: rates of "
            "sked_transitions_total); once per deployment.",
            labels=["state"],
        )
        depth = GaugeMetricFamily(
            "sked_ready_queue_depth",
            "Tasks in the Redis ready queue: in line (ready), parked because no node can take "
            "them (parked), waiting for a named resource (resource) or an earlier attempt's "
            "lease (fenced); once per deployment.",
            labels=["queue"],
        )
        backlog = GaugeMetricFamily(
            "sked_outbox_backlog", "Events not yet published by a relay; once per deployment."
        )
        lag = GaugeMetricFamily(
            "sked_relay_lag_seconds",
            "Age of the oldest event not yet published (0: none), in Postgres time; once per "
            "deployment.",
        )
        if latest is not None:
            counts, depths = latest
            for state in CLUSTER_STATES:
                tasks.add_metric([state], counts.tasks.get(state, 0))
            for queue in QUEUES:
                depth.add_metric([queue], depths.get(queue, 0))
            backlog.add_metric([], counts.outbox_backlog)
            lag.add_metric([], counts.relay_lag_s)
        yield from (tasks, depth, backlog, lag)


CLUSTER = ClusterCollector()
_installed = False


def install() -> None:
    """Plug metrics into sked's hooks and the registry (once per process)."""
    global _installed
    if not _installed:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
        hooks.install(MetricsHook())
        REGISTRY.register(CLUSTER)
        _installed = True


def setup(settings: Settings, service: str) -> int | None:
    """A service process's metrics (services call this once at start, as they set tracing
    up): with SKED_METRICS_PORT >= 0, install the hook and serve GET /metrics (`serve`).
    Returns the port bound."""
    if settings.metrics_port < 0:
        return None
    install()
    if service == "scheduler":
        # a scheduler dispatches as in normal mode until it has read the degrade row
        set_degrade_mode("normal")
    server = serve(settings.metrics_host, settings.metrics_port)
    port = int(server.server_port)
    log.info("%s metrics on http://%s:%d/metrics", service, settings.metrics_host, port)
    return port


def aiohttp_handler() -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """GET /metrics for a service that has an aiohttp app of its own (the operator API):
    `app.router.add_get("/metrics", metrics.aiohttp_handler())`. Installs the hook."""
    from prometheus_client.aiohttp import make_aiohttp_handler

    install()
    return make_aiohttp_handler()


@contextlib.asynccontextmanager
async def cluster(settings: Settings, store: Store, queue: ReadyQueue) -> AsyncIterator[None]:
    """While a service runs (with metrics on): stand for computing the cluster-wide gauges,
    and compute them every SKED_METRICS_CLUSTER_S while elected."""
    if settings.metrics_port < 0:
        yield
        return
    install()
    gauges = store.cluster_gauges()
    loop = asyncio.create_task(_lead(gauges, queue, settings.metrics_cluster_s))
    try:
        yield
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        CLUSTER.latest = None
        with contextlib.suppress(Exception):
            await gauges.resign()


async def _lead(gauges: ClusterGauges, queue: ReadyQueue, period_s: float) -> None:
    failing = False
    while True:
        try:
            was = gauges.leading
            if await gauges.lead():
                if not was:
                    log.info("this process computes the cluster-wide gauges")
                counts = await gauges.read(CLUSTER_STATES)
                CLUSTER.latest = (counts, await queue.depths())
            failing = False
        except Exception as exc:  # Postgres or Redis away: another process may take over
            CLUSTER.latest = None
            if not failing:
                log.warning("cluster-wide gauges not computed: %s", one_line(exc))
            failing = True
            with contextlib.suppress(Exception):
                await gauges.resign()
        await asyncio.sleep(period_s)
