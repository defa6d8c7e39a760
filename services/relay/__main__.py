"""Wire settings -> Postgres pool, AMQP bus -> Relay, and run it: `sked service relay`."""

from __future__ import annotations

import argparse
import sys

from services.relay.service import Relay
from shared.runtime import run_service, service_args
from shared.settings import Settings
from shared.wiring import relay_idle_in_tx_s, serving


def parser() -> argparse.ArgumentParser:
    return service_args("relay", "Publish the outbox (task_events) to RabbitMQ.")


def run(argv: list[str] | None = None) -> int:
    parser().parse_args(argv or [])
    return run_service(
        "relay", Settings(), serving(lambda s, b: Relay(s, b.store, b.bus), relay_idle_in_tx_s)
    )


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
