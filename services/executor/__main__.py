"""Wire settings and flags -> Executor with the local backend: `sked service executor [...]`."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from services.executor.backends.local import LocalBackend
from services.executor.service import Executor
from shared.runtime import run_service, serve
from shared.settings import Settings, parse_labels
from shared.wiring import backends


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="sked service executor",
        description="Run one executor (one node): start dispatched attempts, renew their "
        "leases, report their outcomes. Flags override the SKED_* variables.",
    )
    p.add_argument("--node-id", help="this node's id (SKED_NODE_ID; default: the host name)")
    p.add_argument("--slots", type=int, help="attempts run at once (SKED_SLOTS)")
    p.add_argument("--cpu", type=float, help="cpu capacity (SKED_NODE_CPU)")
    p.add_argument("--memory", type=int, help="memory capacity in MB (SKED_NODE_MEMORY_MB)")
    p.add_argument("--gpu", type=int, help="gpu count (SKED_NODE_GPU)")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="a node label")
    p.add_argument("--state-dir", type=Path, help="logs and running-attempt records")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    overrides: dict[str, object] = {}
    for flag, field in (
        ("node_id", "node_id"),
        ("slots", "slots"),
        ("cpu", "node_cpu"),
        ("memory", "node_memory_mb"),
        ("gpu", "node_gpu"),
        ("state_dir", "state_dir"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides[field] = value
    if args.label:
        overrides["node_labels"] = {**Settings().node_labels, **parse_labels(",".join(args.label))}
    return Settings(**overrides)  # type: ignore[arg-type]


async def main(settings: Settings) -> None:
    state_dir = settings.state_dir or Path(tempfile.gettempdir()) / "sked" / settings.node_id
    async with backends(settings) as b:
        backend = LocalBackend(
            settings.slots,
            state_dir,
            warm_workers=settings.warm_workers,
            env_pass=settings.task_env_pass,
            freeze_max_s=settings.freeze_max_s,
        )
        await serve(Executor(settings, b.store, b.bus, backend, b.ready_queue))


def run(argv: list[str] | None = None) -> int:
    settings = settings_from(parse_args(argv))
    return run_service(
        "executor", settings, main, log_as=f"executor[{settings.node_id}]", signs_heartbeats=True
    )


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
