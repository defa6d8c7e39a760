"""Wire settings -> Postgres, Redis, RabbitMQ -> Scheduler, and run it: `sked service scheduler`."""

from __future__ import annotations

import argparse
import sys

from services.scheduler.service import Scheduler
from shared.runtime import run_service, service_args
from shared.settings import Settings
from shared.wiring import serving

ABOUT = "Admit submissions, order them by aged priority, place and dispatch them."


def parser() -> argparse.ArgumentParser:
    return service_args("scheduler", ABOUT)


def run(argv: list[str] | None = None) -> int:
    parser().parse_args(argv or [])
    build = serving(lambda settings, b: Scheduler(settings, b.store, b.bus, b.ready_queue))
    return run_service("scheduler", Settings(), build)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
