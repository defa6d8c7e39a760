"""Settings come from the environment, an operator's input: a number that is not finite is
refused with the variable named, where pydantic's bounds alone would let `inf` through (a
recovery period of inf would sleep forever)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.errors import InvalidSettings
from shared.settings import Settings


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
@pytest.mark.parametrize("name", ["recovery_period_s", "node_ttl_s", "aging_s", "node_cpu"])
def test_a_setting_that_is_not_a_finite_number_is_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(f"SKED_{name.upper()}", value)
    with pytest.raises(InvalidSettings, match=f"SKED_{name.upper()}"):
        Settings()


def test_finite_settings_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKED_RECOVERY_PERIOD_S", "0.5")
    assert Settings().recovery_period_s == 0.5


def test_every_setting_is_documented_in_the_readme() -> None:
    """The README's configuration table names every SKED_* variable a process reads."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text("utf-8")
    missing = [f"SKED_{name.upper()}" for name in Settings.model_fields]
    assert [v for v in missing if f"`{v}`" not in readme] == []


LOOP_PERIODS = [
    "relay_sweep_s",
    "reconcile_s",
    "recovery_period_s",
    "retention_check_s",
    "degrade_check_s",
    "node_heartbeat_s",
    "k8s_relist_s",
    "metrics_cluster_s",
    "heartbeat_flush_s",
]


@pytest.mark.parametrize("value", ["1e-300", "0.0001"])
@pytest.mark.parametrize("name", LOOP_PERIODS)
def test_a_loop_period_too_short_to_sleep_is_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A period is how long a loop sleeps between passes against Postgres, Redis or the
    Kubernetes API: one of 1e-300 s would spin the loop on those servers, so every period has
    a floor, and the refusal names the variable."""
    monkeypatch.setenv(f"SKED_{name.upper()}", value)
    with pytest.raises(InvalidSettings, match=f"SKED_{name.upper()}"):
        Settings()


@pytest.mark.parametrize("name", LOOP_PERIODS)
def test_a_loop_period_at_the_floor_is_taken(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(f"SKED_{name.upper()}", "0.01")
    if name == "node_heartbeat_s":
        monkeypatch.setenv("SKED_NODE_TTL_S", "1")
    assert getattr(Settings(), name) == 0.01


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SKED_API_HOST", ""),  # aiohttp would listen on every interface
        ("SKED_MONITOR_HOST", "  "),
        ("SKED_METRICS_HOST", ""),
        ("SKED_STATE_DIR", ""),  # Path("") is the working directory
        ("SKED_DEAD_MAX_MESSAGES", str(2**63)),  # past what an AMQP table holds
        ("SKED_DEAD_MAX_BYTES", str(2**63)),
        ("SKED_K8S_JOB_TTL_S", str(2**31)),  # a Job's ttlSecondsAfterFinished is int32
        ("SKED_K8S_TOLERATIONS", "[" * 100_000 + "]" * 100_000),  # RecursionError in json
        ("SKED_FINISH_LINGER_S", "1e8"),  # outcomes would wait that long to be written
        ("SKED_DISPATCH_LINGER_S", "5"),
        ("SKED_RELAY_LINGER_S", "60"),
        ("SKED_PROBE_TIMEOUT_S", "1e-9"),  # no executor could ever answer in time
        ("SKED_STUCK_SCHEDULING_S", "1e-7"),
    ],
)
def test_a_setting_that_would_break_a_service_later_is_refused_naming_it(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidSettings, match=name):
        Settings()


def test_a_heartbeat_secret_of_blanks_is_not_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKED_HEARTBEAT_SECRET", " " * 16)
    with pytest.raises(ValueError, match="SKED_HEARTBEAT_SECRET"):
        Settings().require_heartbeat_secret()
