"""Wire settings -> Recovery, and run it: `sked service recovery`."""

from __future__ import annotations

import argparse
import sys

from services.recovery.service import Recovery
from shared.alerts import Alerter
from shared.relay import OutboxRelay
from shared.runtime import run_service, service_args
from shared.settings import Settings
from shared.wiring import Backends, relay_idle_in_tx_s, serving

ABOUT = "Retry lost tasks, requeue stuck ones, repair the ready queue and the outbox."


def build(settings: Settings, b: Backends) -> Recovery:
    relay = OutboxRelay(
        b.store,
        b.bus,
        settings.relay_batch,
        vacuum_rows=settings.relay_vacuum_rows,
        confirm_timeout_s=settings.relay_confirm_timeout_s,
    )
    alerter = Alerter(b.bus, settings.alertmanager_url)
    return Recovery(settings, b.store, b.ready_queue, relay, alerter)


def parser() -> argparse.ArgumentParser:
    return service_args("recovery", ABOUT)


def run(argv: list[str] | None = None) -> int:
    parser().parse_args(argv or [])
    return run_service("recovery", Settings(), serving(build, relay_idle_in_tx_s))


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
