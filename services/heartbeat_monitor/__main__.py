"""Wire settings -> HeartbeatMonitor, and run it: `sked service heartbeat-monitor [--port N]`."""

from __future__ import annotations

import argparse
import sys

from services.heartbeat_monitor.service import HeartbeatMonitor
from shared.runtime import run_service, serve
from shared.settings import Settings
from shared.wiring import backends


async def main(settings: Settings) -> None:
    async with backends(settings) as b:
        await serve(HeartbeatMonitor(settings, b.store, b.bus))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="sked service heartbeat-monitor",
        description="Take heartbeats (RabbitMQ, HTTP) and confirm losses by the ladder. "
        "Configured by SKED_* environment variables (README); flags override them.",
    )
    p.add_argument("--host", help="listen address for POST /heartbeat (SKED_MONITOR_HOST)")
    p.add_argument("--port", type=int, help="listen port (SKED_MONITOR_PORT; 0: any free)")
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {
        k: v for k, v in (("monitor_host", args.host), ("monitor_port", args.port)) if v is not None
    }
    return run_service("heartbeat-monitor", Settings(**overrides), main, signs_heartbeats=True)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
