"""Wire settings -> Postgres pool, AMQP bus -> Relay, and run it: `sked service relay`."""

from __future__ import annotations

import sys

from services.relay.service import Relay
from shared import telemetry
from shared.runtime import configure_logging, run_main, serve
from shared.settings import Settings
from shared.wiring import backends


async def main(settings: Settings) -> None:
    async with backends(settings) as b:
        await serve(Relay(settings, b.pool, b.bus))


def run(argv: list[str] | None = None) -> int:
    settings = Settings()
    configure_logging(settings, "relay")
    telemetry.setup("sked-relay")
    return run_main(lambda: main(settings))


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
