"""Wire settings -> Postgres, Redis, RabbitMQ -> Scheduler, and run it: `sked service scheduler`."""

from __future__ import annotations

import sys

from services.scheduler.service import Scheduler
from shared.runtime import run_service, serve, service_args
from shared.settings import Settings
from shared.wiring import backends


async def main(settings: Settings) -> None:
    async with backends(settings) as b:
        await serve(Scheduler(settings, b.store, b.bus, b.ready_queue))


def run(argv: list[str] | None = None) -> int:
    service_args(
        "scheduler",
        argv,
        "Admit submissions, order them by aged priority, place and dispatch them.",
    )
    return run_service("scheduler", Settings(), main)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
