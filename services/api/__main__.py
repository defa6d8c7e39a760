"""Wire settings -> the operator API, and run it: `sked service api [--host H] [--port N]`."""

from __future__ import annotations

import argparse
import sys

from services.api.service import Api
from shared.runtime import flag_settings, run_service, service_args
from shared.wiring import serving

ABOUT = "Serve the operator API (/v1: tasks, workflows, nodes; bearer tokens with roles)."


def parser() -> argparse.ArgumentParser:
    p = service_args("api", ABOUT)
    p.add_argument("--host", help="listen address (SKED_API_HOST)")
    p.add_argument("--port", type=int, help="listen port (SKED_API_PORT; 0: any free)")
    return p


def run(argv: list[str] | None = None) -> int:
    settings = flag_settings(
        parser().parse_args(argv or []), {"host": "api_host", "port": "api_port"}
    )
    return run_service("api", settings, serving(lambda s, b: Api(b)))


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
