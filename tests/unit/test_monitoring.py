"""What ships for monitoring — deploy/prometheus/ (scrape configurations, alert rules) and
deploy/grafana/ (the dashboard and its provisioning) — checked without Docker: promtool (from
Debian's prometheus package, which scripts/test installs) checks the rules and the compose
scrape configuration; every expression names only series sked exports; compose.yaml runs
Prometheus and Grafana on these files and Prometheus scrapes every sked service."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared import metrics
from tests.servers import MISSING, PROMTOOL
from tests.unit.test_compose import environment, load_compose, long_running

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}


def exported() -> set[str]:
    """Every series name sked's metrics module exports."""
    collectors: list[Any] = [
        metrics.MOVES,
        metrics.START_LATENCY,
        metrics.RUN,
        metrics.LOST,
        metrics.RETRIES,
        metrics.DISPATCH_PASS,
        metrics.HEARTBEATS,
        metrics.REFUSED,
        metrics.DEGRADE,
        metrics.CLUSTER,
    ]
    return {
        family.name + suffix
        for c in collectors
        for family in c.describe()
        for suffix in SUFFIXES[family.type]
    }


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:  # scripts/test installs it: missing is a broken test bed, not a skip
        pytest.fail(MISSING.format("promtool"))
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False, cwd=PROMETHEUS
    )


def test_promtool_accepts_the_alert_rules() -> None:
    done = promtool("check", "rules", "sked-rules.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_accepts_the_compose_scrape_configuration() -> None:
    # it loads the rule files the configuration names, so those are checked too
    done = promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_catches_a_broken_rule(tmp_path: Path) -> None:
    rules = (PROMETHEUS / "sked-rules.yml").read_text("utf-8")
    broken = tmp_path / "broken.yml"
    broken.write_text(rules.replace("sum(increase(", "sum(increase((", 1))
    done = promtool("check", "rules", str(broken))
    assert done.returncode != 0


def expressions() -> list[str]:
    board = json.loads((GRAFANA / "dashboards" / "sked.json").read_text("utf-8"))
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    rules = yaml.safe_load((PROMETHEUS / "sked-rules.yml").read_text("utf-8"))
    return exprs + [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_every_expression_names_series_sked_exports() -> None:
    known = exported()
    assert {"sked_transitions_total", "sked_tasks", "sked_task_run_seconds_bucket"} <= known
    used = {n for e in expressions() for n in re.findall(r"\bsked_\w+", e)}
    assert used - known == set()
    # the dashboard shows every family sked exports
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}
    assert {re.sub(r"_(bucket|count|sum)$", "", n) for n in known} <= families


def test_the_dashboard_reads_the_provisioned_data_source() -> None:
    board = json.loads((GRAFANA / "dashboards" / "sked.json").read_text("utf-8"))
    source = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uid = source["datasources"][0]["uid"]
    assert {p["datasource"]["uid"] for p in board["panels"]} == {uid}
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_compose_runs_prometheus_and_grafana_on_the_shipped_files() -> None:
    services = load_compose()["services"]
    mounts = {
        name: {v.split(":")[1]: v.split(":")[0] for v in services[name]["volumes"]}
        for name in ("prometheus", "grafana")
    }
    for name, targets in mounts.items():
        for source in targets.values():
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}: no such file"
    config = mounts["prometheus"]["/etc/prometheus/prometheus.yml"]
    assert config == "./deploy/prometheus/prometheus.yml"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "sked.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts["grafana"][path] == "./deploy/grafana/dashboards"


def test_prometheus_scrapes_every_sked_service_at_its_metrics_port() -> None:
    doc = load_compose()
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text("utf-8"))
    scraped = {
        sd["names"][0]: (job["job_name"], sd["port"])
        for job in config["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
    }
    for name, svc in long_running(doc).items():
        port = int(environment(svc)["SKED_METRICS_PORT"])
        assert environment(svc)["SKED_METRICS_HOST"] == "0.0.0.0", name
        assert scraped.get(name) == (f"sked-{name}", port), f"{name} is not scraped at {port}"


def test_the_kubernetes_scrape_configuration_follows_the_pod_annotations() -> None:
    # Debian's promtool is built without Kubernetes discovery: the shape is checked here
    config = yaml.safe_load((PROMETHEUS / "kubernetes.yml").read_text("utf-8"))
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    relabels = {tuple(r["source_labels"]): r for r in job["relabel_configs"]}
    keep = relabels[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)]
    assert (keep["action"], keep["regex"]) == ("keep", "true")
    named = relabels[("__meta_kubernetes_pod_label_app_kubernetes_io_component",)]
    assert (named["target_label"], named["replacement"]) == ("job", "sked-$1")
    assert config["rule_files"] == ["sked-rules.yml"]
