"""Wire settings -> Recovery, and run it: `sked service recovery`."""

from __future__ import annotations

import sys

from services.recovery.service import Recovery
from services.relay.service import Relay
from shared import telemetry
from shared.runtime import configure_logging, run_main, serve
from shared.settings import Settings
from shared.wiring import backends


async def main(settings: Settings) -> None:
    async with backends(settings) as b:
        relay = Relay(settings, b.pool, b.bus)
        await serve(Recovery(settings, b.tasks, b.ready_queue, relay))


def run(argv: list[str] | None = None) -> int:
    settings = Settings()
    configure_logging(settings, "recovery")
    telemetry.setup("sked-recovery")
    return run_main(lambda: main(settings))


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
