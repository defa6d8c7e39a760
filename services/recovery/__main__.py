"""Wire settings -> Recovery, and run it: `sked service recovery`."""

from __future__ import annotations

import sys

from services.recovery.service import Recovery
from shared.relay import OutboxRelay
from shared.runtime import run_service, serve, service_args
from shared.settings import Settings
from shared.wiring import backends


async def main(settings: Settings) -> None:
    async with backends(settings) as b:
        relay = OutboxRelay(b.store, b.bus, settings.relay_batch)
        await serve(Recovery(settings, b.store, b.ready_queue, relay))


def run(argv: list[str] | None = None) -> int:
    service_args(
        "recovery",
        argv,
        "Retry lost tasks, requeue stuck ones, repair the ready queue and the outbox.",
    )
    return run_service("recovery", Settings(), main)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
