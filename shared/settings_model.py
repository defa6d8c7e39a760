"""The settings model: `SKED_*` variables read and checked by pydantic-settings. Import
`Settings` from `shared.settings`, which loads this module on first use."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.backlog import ROUNDS
from shared.errors import InvalidSettings
from shared.settings import DATABASE_SCHEMES, DEFAULT_DATABASE_URL, PREFIX, refusals, url_problem


def _total_memory_mb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError, AttributeError):  # not every platform names these
        return 1024


def parse_labels(value: Any) -> dict[str, str]:
    """Labels from `k=v,k2=v2`, a JSON object, or a dict: string values only (a JSON null or
    object was stored as 'None' or a Python repr), and no NUL (jsonb refuses it)."""
    if isinstance(value, dict):
        labels = {}
        for k, v in value.items():
            if not isinstance(v, str):
                raise ValueError(f"label {str(k)!r}: a value must be a string")
            if "\x00" in f"{k}{v}":
                raise ValueError(f"label {str(k)!r}: a label holds no NUL character")
            labels[str(k)] = v
        return labels
    text = str(value or "").strip()
    if not text:
        return {}
    if text.startswith("{"):
        return parse_labels(json.loads(text))
    labels = {}
    for part in text.split(","):
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"a label must look like key=value, got {part!r}")
        labels[key.strip()] = val.strip()
    return parse_labels(labels)  # the NUL check


# nodes.id's CHECK (shared/store/schema.sql): a letter or digit, then up to 62 of [A-Za-z0-9_.-]
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"

WEAK_SECRET = "sked-dev-heartbeat-secret"  # the old default: never accepted


# Every duration (a `*_s` setting) at most this long: Postgres adds some to timestamps, where
# 1e300 s wrapped to a negative interval and failed every read of the nodes.
MAX_DURATION_S = 1e8  # three years
# Loops sleep a period between passes against the servers, idle or not: 1e-300 s would spin
MIN_PERIOD_S = 0.01
# a batching window longer than this would hold what it batches (outcomes, dispatches, events)
MAX_LINGER_S = 1.0
URL_SCHEMES = {
    "database_url": DATABASE_SCHEMES,
    "redis_url": ("redis", "rediss", "unix"),
    "rabbitmq_url": ("amqp", "amqps"),
    "heartbeat_url": ("http", "https"),
    "api_url": ("http", "https"),
    "alertmanager_url": ("http", "https"),
    "k8s_api_url": ("http", "https"),
}


class Settings(BaseSettings):
    # allow_inf_nan: a duration of "inf" would sleep forever, "nan" compare false everywhere;
    # hide_input_in_errors: a refusal must not quote the variables (secrets among them)
    model_config = SettingsConfigDict(
        env_prefix=PREFIX, extra="ignore", allow_inf_nan=False, hide_input_in_errors=True
    )

    def __init__(self, **values: Any) -> None:
        """Read and check the variables; InvalidSettings names each one refused and why, and
        never its value (a URL's password, the heartbeat secret)."""
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise InvalidSettings(refusals(exc)) from None

    database_url: str = DEFAULT_DATABASE_URL
    redis_url: str = "redis://127.0.0.1:6379/0"
    rabbitmq_url: str = "amqp://guest:guest@127.0.0.1:5672/"

    db_pool_size: int = Field(default=8, ge=1, le=200)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    log_json: bool = False

    # Outbox relay: the largest batch read per pass, and the safety sweep period that catches
    # events whose NOTIFY was missed (a listener reconnect, a relay crash).
    relay_batch: int = Field(default=1000, ge=1, le=10_000)
    relay_sweep_s: float = Field(default=5.0, ge=MIN_PERIOD_S)
    # The batching window after a wake. Events feed observers only (no service of sked
    # consumes them), so they may wait a little: at 100 tasks/s, 100 ms rather than 20 ms
    # halves the relay's CPU a task and the Postgres and RabbitMQ work its passes cost.
    relay_linger_s: float = Field(default=0.1, ge=0, le=MAX_LINGER_S, description="batch window")
    # A relay vacuums the outbox after deleting this many rows (0: never, autovacuum's alone):
    # the deleted rows' key entries are walked by every read until a vacuum (shared.relay).
    relay_vacuum_rows: int = Field(default=10_000, ge=0, description="outbox rows between vacuums")
    # the longest a relay's pass waits for publisher confirms while it holds its outbox shards
    relay_confirm_timeout_s: float = Field(default=10.0, ge=MIN_PERIOD_S)

    # Scheduler.
    aging_s: float = Field(default=5.0, ge=0, description="waiting this long = +1 priority")
    max_message_bytes: int = Field(default=1024 * 1024, ge=1024)
    # sked.dead's bounds, set when it is first declared: past either the oldest go (shared.bus)
    dead_max_messages: int = Field(default=100_000, ge=1, le=2**63 - 1)  # an AMQP long
    dead_max_bytes: int = Field(default=1024**3, ge=1024, le=2**63 - 1)
    submit_batch: int = Field(default=500, ge=1, le=10_000)
    dispatch_batch: int = Field(default=500, ge=1, le=10_000)
    reconcile_s: float = Field(
        default=5.0, ge=MIN_PERIOD_S, description="queue/Postgres consistency check"
    )
    # How long the dispatch message of an attempt placed at admission waits: its node is told
    # by the placement's commit and claims it from there; the message goes out only if the
    # attempt is still unclaimed after this (services/scheduler/follow.py). 0: at once.
    dispatch_follow_s: float = Field(default=0.5, ge=0, le=10)
    node_ttl_s: float = Field(default=10.0, gt=0, description="a node silent this long is gone")
    # A node gone this long, holding no attempt and not cordoned, is forgotten: its row is
    # deleted (recovery), so that executors that come and go (scaled containers, autoscaled
    # cluster nodes) do not pile up in every placement's read. 0: never. At least
    # degrade_nodes_seen_s: the healthy-nodes trigger counts the nodes seen in that window.
    node_forget_s: float = Field(default=7 * 86_400.0, ge=0)

    # Heartbeats and recovery.
    heartbeat_secret: str = Field(
        default="",
        description="signs per-attempt heartbeat tokens; executors and monitors refuse to "
        "start without one (`sked dev` makes one)",
    )
    heartbeat_url: str = "http://127.0.0.1:8470/heartbeat"  # given to every task process
    monitor_host: str = "127.0.0.1"
    monitor_port: int = Field(default=8470, ge=0, le=65535)
    heartbeat_flush_s: float = Field(
        default=0.1, ge=MIN_PERIOD_S, description="batch window for beats"
    )
    probe_timeout_s: float = Field(default=2.0, ge=MIN_PERIOD_S, description="a backend's answer")
    recovery_period_s: float = Field(default=2.0, ge=MIN_PERIOD_S)
    # How long past an attempt's lease its task may be declared Lost or start again: covers
    # the node watchdog's reaction time (docs/architecture.md, "At most one live attempt").
    lease_margin_s: float = Field(default=0.5, ge=0.1, le=60)
    stuck_scheduling_s: float = Field(default=30.0, ge=MIN_PERIOD_S, description="not started")
    # Retention (services/recovery): tasks that ended this many days ago or longer are deleted
    # with their history (a workflow's only with the whole workflow), and their idempotency
    # keys are free again. 0: every task is kept forever.
    retention_days: float = Field(default=0, ge=0, le=36_500)
    # the operator API's audit rows (api_audit: every change, submissions included) older than
    # this many days are deleted by the same loop. 0: kept forever. Apart from retention_days:
    # an audit is often kept longer than the work it records.
    audit_retention_days: float = Field(default=0, ge=0, le=36_500)
    # how often recovery looks for tasks past the retention (at once again while it finds more)
    retention_check_s: float = Field(default=60.0, ge=MIN_PERIOD_S)

    # The operator API (services/api): where it listens (port 0: any free one). With both
    # api_url (e.g. http://127.0.0.1:8480) and api_token set, the CLI's read and control
    # commands go through the API instead of the database.
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8480, ge=0, le=65535)
    api_url: str | None = None
    api_token: str | None = None

    # Executor (one process = one node).
    # what the nodes row holds: nodes.id's CHECK, memory_mb a bigint, gpu an integer
    node_id: str = Field(
        default_factory=lambda: socket.gethostname().split(".")[0] or "node",
        pattern=NODE_ID_PATTERN,  # at most 63 characters
    )
    slots: int = Field(default=4, ge=1, le=10_000)
    # Dispatches a node holds beyond its slots, each started the moment a slot frees, so its
    # slots never wait for a round through the scheduler (shared/backlog.py). Unset: up to
    # four times its slots, as deep as its attempts are short, and one held
    # backlog_hold_s handed back to Ready; a number: always that many, each held until a slot
    # frees (for tasks known to be short); 0: none. Local nodes only.
    prefetch: int | None = Field(default=None, ge=0, le=10_000)
    backlog_hold_s: float = Field(default=2.0, gt=0)
    node_cpu: float = Field(default_factory=lambda: float(os.cpu_count() or 1), ge=0)
    node_memory_mb: int = Field(default_factory=_total_memory_mb, ge=0, le=2**63 - 1)
    node_gpu: int = Field(default=0, ge=0, le=2**31 - 1)
    node_labels: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    node_heartbeat_s: float = Field(default=2.0, ge=MIN_PERIOD_S)
    state_dir: Path | None = None  # default: <tmp>/sked/<node_id>
    # handler workers started with the executor (the rest start on their slot's first handler)
    warm_workers: int = Field(default=2, ge=0, le=10_000)
    # a handler worker is replaced after this many jobs (0: never): each job's environment
    # costs a worker ~220 bytes it never frees (glibc's setenv), and handlers may leak too
    worker_max_jobs: int = Field(default=10_000, ge=0)
    # a running attempt's log past this is cut to its last half (backends/local/logcap.py)
    log_max_bytes: int = Field(default=64 * 2**20, ge=64 * 1024, le=2**62)
    # handler jobs one worker may hold at once while the node's jobs run short: the one it
    # runs and those waiting behind it, which then cost no wake-up of an idle worker (1: a
    # job only ever goes to an idle worker)
    worker_depth: int = Field(default=8, ge=1, le=1_000)
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    # An attempt whose lease could not be renewed is frozen (SIGSTOP); frozen this long, it
    # is killed. Longer rides out longer Postgres outages; shorter frees its resources sooner.
    freeze_max_s: float = Field(default=600.0, gt=0)
    # Variables a task's process gets from the executor's environment besides PATH, HOME,
    # LANG and TZ (comma-separated names, e.g. PYTHONPATH); never a SKED_* variable.
    task_env_pass: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # Degrade modes (shared/degrade.py). Partial dispatches only tasks at or above this
    # priority, at most this many per pass. The automatic triggers, evaluated every
    # degrade_check_s by one scheduler: GPUs held above a share of the healthy nodes' ->
    # partial; fewer than a share of the nodes seen within degrade_nodes_seen_s healthy ->
    # full; more tasks waiting than a bound -> partial; each for its duration.
    degrade_min_priority: int = Field(default=100, ge=-1000, le=1000)
    degrade_partial_batch: int = Field(default=10, ge=1, le=10_000)
    degrade_check_s: float = Field(default=5.0, ge=MIN_PERIOD_S)
    degrade_gpu_ratio: float = Field(default=0.95, gt=0, le=1)
    degrade_gpu_for_s: float = Field(default=600.0, gt=0)
    degrade_healthy_ratio: float = Field(default=0.5, ge=0, le=1)
    degrade_healthy_for_s: float = Field(default=1800.0, gt=0)
    degrade_waiting: int = Field(default=10_000, ge=0)
    degrade_waiting_for_s: float = Field(default=300.0, gt=0)
    degrade_nodes_seen_s: float = Field(default=3600.0, gt=0)
    # an automatic mode whose cause has been gone this long ends before its time
    degrade_calm_s: float = Field(default=60.0, gt=0)
    # Alerts (shared/alerts.py): Alertmanager's base URL (unset: logged and published only),
    # and the backlogs past which an alert fires.
    alertmanager_url: str | None = None
    alert_outbox_backlog: int = Field(default=100_000, ge=1)
    alert_ready_backlog: int = Field(default=50_000, ge=1)
    # Prometheus metrics (shared/metrics.py): GET /metrics on this port (0: any free one, named
    # in the log; -1: off, the default, as several processes share a host in `sked dev` and
    # tests), on this address (containers set 0.0.0.0). The processes with metrics on elect
    # one (a Postgres advisory lock) to compute the cluster-wide gauges every metrics_cluster_s.
    metrics_port: int = Field(default=-1, ge=-1, le=65535)
    metrics_host: str = "127.0.0.1"
    metrics_cluster_s: float = Field(default=5.0, ge=MIN_PERIOD_S)

    # Where an executor runs attempts: "local" processes on this machine (one executor = one
    # node), or "kubernetes" Jobs on a cluster's nodes (one executor serves the cluster).
    backend: Literal["local", "kubernetes"] = "local"
    # Kubernetes backend. Its config comes from k8s_kubeconfig, else the in-cluster service
    # account. The namespace the Jobs go to; the label selector choosing the nodes sked may
    # place on (every node when empty); tolerations (a JSON list) and image pull secrets
    # (comma-separated names) for every Job; finished Jobs are deleted after k8s_job_ttl_s.
    k8s_kubeconfig: Path | None = None
    # An API server URL used as it is, without credentials (`kubectl proxy`; a test's fake).
    k8s_api_url: str | None = None
    k8s_context: str | None = None
    k8s_namespace: str = "sked-jobs"
    k8s_node_selector: str = ""
    k8s_tolerations: Annotated[list[dict[str, Any]], NoDecode] = Field(default_factory=list)
    k8s_image_pull_secrets: Annotated[list[str], NoDecode] = Field(default_factory=list)
    k8s_job_ttl_s: int = Field(default=3600, ge=0, le=2**31 - 1)  # the Job's int32
    # A pod that has not started its container this long after its Job was created (image
    # pull back-off, unschedulable) is a launch failure: the task goes back to Ready.
    k8s_start_budget_s: float = Field(default=300.0, gt=0)
    # A node that turned NotReady gets this long before its attempts are judged by their
    # Job's status and their log's freshness (the loss ladder's first rung).
    k8s_node_grace_s: float = Field(default=40.0, ge=0)
    # Every list is repeated this often: a watch alone is never trusted.
    k8s_relist_s: float = Field(default=60.0, ge=MIN_PERIOD_S)

    # What this deployment runs at all (shared.policy): handler module prefixes and command
    # programs (a directory ends in "/"); empty allows everything.
    allowed_handlers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    allowed_commands: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Outcomes wait this long to share one transaction: results land a few ms later, and
    # Postgres does one statement where it would do one per task.
    finish_linger_s: float = Field(default=0.005, ge=0, le=MAX_LINGER_S)
    # A dispatch pass woken by a freed slot waits this long for more slots to free: under
    # saturation one pass then places many tasks (a newly submitted task never waits for it).
    dispatch_linger_s: float = Field(default=0.005, ge=0, le=MAX_LINGER_S)

    @field_validator("node_labels", mode="before")
    @classmethod
    def _labels(cls, value: Any) -> dict[str, str]:
        return parse_labels(value)

    @field_validator("k8s_tolerations", mode="before")
    @classmethod
    def _tolerations(cls, value: Any) -> list[dict[str, Any]]:
        if isinstance(value, list):
            return value
        text = str(value or "").strip()
        try:
            return json.loads(text) if text else []
        except RecursionError:
            raise ValueError("nested too deeply") from None

    @field_validator(
        "task_env_pass",
        "allowed_handlers",
        "allowed_commands",
        "k8s_image_pull_secrets",
        mode="before",
    )
    @classmethod
    def _names(cls, value: Any) -> list[str]:
        items = value if isinstance(value, list) else str(value or "").split(",")
        return [str(v).strip() for v in items if str(v).strip()]

    @field_validator("monitor_host", "api_host", "metrics_host", "state_dir", mode="before")
    @classmethod
    def _not_blank(cls, value: Any) -> Any:
        # a blank host is every interface to aiohttp, and a blank directory the current one
        if isinstance(value, str) and not value.strip():
            raise ValueError("is set but blank: unset it for its default")
        return value

    @field_validator("allowed_commands")
    @classmethod
    def _programs(cls, value: list[str]) -> list[str]:
        # a bare name would be looked up in whatever PATH the job sets: "rsync" allows any
        # program named so, anywhere
        bare = [v for v in value if not v.startswith("/")]
        if bare:
            raise ValueError(
                f"must be absolute paths (a program, or a directory ending in /): {bare[0]!r}"
            )
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator(*URL_SCHEMES, mode="after")
    @classmethod
    def _url(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A URL a client library can read (shared.settings.url_problem); never echoed."""
        if value is not None and (why := url_problem(value, URL_SCHEMES[info.field_name or ""])):
            raise ValueError(why)
        return value

    @model_validator(mode="after")
    def _durations(self) -> Settings:
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name.endswith("_s") and isinstance(value, float) and value > MAX_DURATION_S:
                raise ValueError(f"{PREFIX}{name.upper()} is over {MAX_DURATION_S:g} s")
        return self

    @model_validator(mode="after")
    def _forget_after_seen(self) -> Settings:
        if 0 < self.node_forget_s < max(self.degrade_nodes_seen_s, self.node_ttl_s):
            raise ValueError(
                f"SKED_NODE_FORGET_S ({self.node_forget_s:g}) must be 0 (never) or at least"
                f" SKED_DEGRADE_NODES_SEEN_S ({self.degrade_nodes_seen_s:g}) and"
                f" SKED_NODE_TTL_S ({self.node_ttl_s:g}): a node is forgotten only once"
                " nothing counts it"
            )
        return self

    @model_validator(mode="after")
    def _beat_within_ttl(self) -> Settings:
        if self.node_heartbeat_s > self.node_ttl_s / 2:
            raise ValueError(
                f"SKED_NODE_HEARTBEAT_S ({self.node_heartbeat_s:g}) must be at most half of"
                f" SKED_NODE_TTL_S ({self.node_ttl_s:g}): a node that beats less often is"
                " dead to placement between its beats, or flaps on any delay"
            )
        return self

    @field_validator("task_env_pass")
    @classmethod
    def _no_secrets(cls, names: list[str]) -> list[str]:
        leaked = [n for n in names if n.upper().startswith("SKED_")]
        if leaked:
            raise ValueError(f"tasks never get sked's own variables: {', '.join(leaked)}")
        return names

    @property
    def dead_max(self) -> tuple[int, int]:  # sked.dead's bounds (shared.bus.AmqpBus)
        return self.dead_max_messages, self.dead_max_bytes

    @property
    def backlog_limit(self) -> int:
        """The most dispatches a local node holds beyond its slots (SKED_PREFETCH; unset:
        shared.backlog.ROUNDS times its slots)."""
        return self.slots * ROUNDS if self.prefetch is None else self.prefetch

    @property
    def backlog_hold(self) -> float | None:
        """How long a held dispatch may wait for a slot; None: a fixed backlog."""
        return self.backlog_hold_s if self.prefetch is None else None

    def require_heartbeat_secret(self) -> str:
        """The heartbeat secret, or a clear error: a guessable secret would let anyone forge
        heartbeats, so services that sign or check them do not start without a real one."""
        if len(self.heartbeat_secret.strip()) < 16 or self.heartbeat_secret == WEAK_SECRET:
            raise ValueError(
                "SKED_HEARTBEAT_SECRET must be set to a secret of at least 16 characters "
                "(e.g. `openssl rand -hex 32`); `sked dev` makes one for you"
            )
        return self.heartbeat_secret
