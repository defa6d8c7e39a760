"""Wire settings -> HeartbeatMonitor, and run it: `sked service heartbeat-monitor [--port N]`."""

from __future__ import annotations

import argparse
import sys

from services.heartbeat_monitor.service import HeartbeatMonitor
from shared.runtime import flag_settings, run_service, service_args
from shared.wiring import serving

ABOUT = "Take heartbeats (RabbitMQ, HTTP) and confirm losses by the ladder."


def parser() -> argparse.ArgumentParser:
    p = service_args("heartbeat-monitor", ABOUT)
    p.add_argument("--host", help="listen address for POST /heartbeat (SKED_MONITOR_HOST)")
    p.add_argument("--port", type=int, help="listen port (SKED_MONITOR_PORT; 0: any free)")
    return p


def run(argv: list[str] | None = None) -> int:
    p = parser()
    settings = flag_settings(
        p.parse_args(argv or []), {"host": "monitor_host", "port": "monitor_port"}
    )
    build = serving(lambda s, b: HeartbeatMonitor(s, b.store, b.bus))
    return run_service("heartbeat-monitor", settings, build, signs_heartbeats=True)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
