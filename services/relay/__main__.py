"""Wire settings -> Postgres pool, AMQP bus -> Relay, and run it: `sked service relay`."""

from __future__ import annotations

import sys

from services.relay.service import Relay
from shared.runtime import run_service, serve, service_args
from shared.settings import Settings
from shared.wiring import backends


async def main(settings: Settings) -> None:
    async with backends(settings) as b:
        await serve(Relay(settings, b.store, b.bus))


def run(argv: list[str] | None = None) -> int:
    service_args("relay", argv, "Publish the outbox (task_events) to RabbitMQ.")
    return run_service("relay", Settings(), main)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
