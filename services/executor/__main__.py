"""Wire settings and flags -> Executor with the local backend: `sked service executor [...]`."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from services.executor.backends.local import LocalBackend
from services.executor.service import Executor
from shared.runtime import flag_settings, run_service, service_args
from shared.settings import Settings, parse_labels
from shared.wiring import Backends, serving

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
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    if not args.label:
        return flag_settings(args, FLAGS)
    labels = {**Settings().node_labels, **parse_labels(",".join(args.label))}
    return flag_settings(args, FLAGS, node_labels=labels)


def build(settings: Settings, b: Backends) -> Executor:
    state_dir = settings.state_dir or Path(tempfile.gettempdir()) / "sked" / settings.node_id
    backend = LocalBackend(
        settings.slots,
        state_dir,
        warm_workers=settings.warm_workers,
        env_pass=settings.task_env_pass,
        freeze_max_s=settings.freeze_max_s,
    )
    return Executor(settings, b.store, b.bus, backend, b.ready_queue)


def run(argv: list[str] | None = None) -> int:
    settings = settings_from(parser().parse_args(argv or []))
    return run_service(
        "executor",
        settings,
        serving(build),
        log_as=f"executor[{settings.node_id}]",
        signs_heartbeats=True,
    )


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
