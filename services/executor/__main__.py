"""Wire settings and flags -> Executor with its backend: `sked service executor [...]`.

`--backend local` (the default): this executor is one node and runs attempts as local
processes. `--backend kubernetes`: it serves a cluster's nodes and runs attempts as Jobs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from services.executor.backends import Backend
from services.executor.backends.local import LocalBackend
from services.executor.service import Executor
from shared.runtime import flag_settings, run_service, service_args
from shared.settings import Settings, parse_labels
from shared.wiring import Backends, node_statement_s, serving

ABOUT = (
    "Run one executor (one node): start dispatched attempts, renew their leases, "
    "report their outcomes."
)
FLAGS = {
    "node_id": "node_id",
    "slots": "slots",
    "cpu": "node_cpu",
    "memory": "node_memory_mb",
    "gpu": "node_gpu",
    "state_dir": "state_dir",
    "backend": "backend",
    "kubeconfig": "k8s_kubeconfig",
    "namespace": "k8s_namespace",
    "node_selector": "k8s_node_selector",
}


def parser() -> argparse.ArgumentParser:
    p = service_args("executor", ABOUT)
    p.add_argument("--node-id", help="this node's id (SKED_NODE_ID; default: the host name)")
    p.add_argument("--slots", type=int, help="attempts run at once (SKED_SLOTS)")
    p.add_argument("--cpu", type=float, help="cpu capacity (SKED_NODE_CPU)")
    p.add_argument("--memory", type=int, help="memory capacity in MB (SKED_NODE_MEMORY_MB)")
    p.add_argument("--gpu", type=int, help="gpu count (SKED_NODE_GPU)")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="a node label")
    p.add_argument("--state-dir", type=Path, help="logs and running-attempt records")
    p.add_argument(
        "--backend",
        choices=["local", "kubernetes"],
        help="where attempts run: local processes, or Jobs on a cluster (SKED_BACKEND)",
    )
    k8s = p.add_argument_group("kubernetes backend")
    k8s.add_argument(
        "--kubeconfig", type=Path, help="default: the in-cluster service account (SKED_K8S_*)"
    )
    k8s.add_argument("--namespace", help="where the Jobs go (SKED_K8S_NAMESPACE)")
    k8s.add_argument(
        "--node-selector",
        help="label selector of the nodes sked places on (SKED_K8S_NODE_SELECTOR)",
    )
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    if not args.label:
        return flag_settings(args, FLAGS)
    labels = {**Settings().node_labels, **parse_labels(",".join(args.label))}
    return flag_settings(args, FLAGS, node_labels=labels)


def local_backend(settings: Settings) -> LocalBackend:
    state_dir = settings.state_dir or Path(tempfile.gettempdir()) / "sked" / settings.node_id
    return LocalBackend(
        settings.slots,
        state_dir,
        warm_workers=settings.warm_workers,
        env_pass=settings.task_env_pass,
        freeze_max_s=settings.freeze_max_s,
        worker_max_jobs=settings.worker_max_jobs,
        worker_depth=settings.worker_depth,
        log_max_bytes=settings.log_max_bytes,
    )


async def kubernetes_backend(settings: Settings, b: Backends) -> Backend:
    from services.executor.backends.kubernetes import KubernetesBackend
    from services.executor.backends.kubernetes.kube import Kube, api_client
    from services.executor.backends.kubernetes.manifest import JobOptions

    s = settings
    api = await api_client(s.k8s_kubeconfig, s.k8s_context, s.k8s_api_url)
    options = JobOptions(
        s.k8s_namespace, s.k8s_job_ttl_s, s.k8s_tolerations, s.k8s_image_pull_secrets
    )
    return KubernetesBackend(
        Kube(api, s.k8s_namespace),
        b.store.launches.by(s.node_id),
        options,
        node_selector=s.k8s_node_selector,
        node_grace_s=s.k8s_node_grace_s,
        start_budget_s=s.k8s_start_budget_s,
        relist_s=s.k8s_relist_s,
    )


async def build(settings: Settings, b: Backends) -> Executor:
    if settings.backend == "kubernetes":
        backend = await kubernetes_backend(settings, b)
    else:
        backend = local_backend(settings)
    return Executor(settings, b.store, b.bus, backend, b.ready_queue)


def run(argv: list[str] | None = None) -> int:
    settings = settings_from(parser().parse_args(argv or []))
    return run_service(
        "executor",
        settings,
        serving(build, statement_s=node_statement_s),
        log_as=f"executor[{settings.node_id}]",
        signs_heartbeats=True,
    )


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
