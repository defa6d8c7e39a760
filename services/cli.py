"""The `sked` command line: operate a deployment, run its services, inspect tasks.

Every command reads the deployment from `SKED_*` variables (shared.settings), like the services.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from shared import fsm
from shared.errors import SkedError
from shared.migrate import migrate
from shared.settings import Settings

SERVICES: dict[str, str] = {
    "relay": "services.relay.__main__",
}


def _cmd_migrate(args: argparse.Namespace) -> int:
    settings = Settings()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    version = asyncio.run(migrate(settings.database_url))
    print(f"schema at version {version}")
    return 0


def _cmd_diagram(args: argparse.Namespace) -> int:
    doc = Path(args.doc)
    if not args.write and not args.check:
        print(fsm.mermaid(), end="")
        return 0
    current = doc.read_text("utf-8")
    fresh = fsm.embed_diagram(current)
    if args.check:
        if fresh != current:
            print(f"{doc}: the state diagram is out of date; run `sked diagram --write`")
            return 1
        print(f"{doc}: the state diagram matches the transition table")
        return 0
    doc.write_text(fresh, "utf-8")
    print(f"{doc}: state diagram written")
    return 0


def _cmd_service(args: argparse.Namespace) -> int:
    module = __import__(SERVICES[args.name], fromlist=["run"])
    code: int = module.run()
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sked", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", help="create the database if needed and apply migrations")
    p.set_defaults(func=_cmd_migrate)

    p = sub.add_parser("diagram", help="print the FSM as Mermaid, or write it into the docs")
    p.add_argument("--doc", default="docs/architecture.md")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the diagram in --doc")
    mode.add_argument("--check", action="store_true", help="exit 1 if --doc is out of date")
    p.set_defaults(func=_cmd_diagram)

    p = sub.add_parser("service", help="run one sked service in the foreground")
    p.add_argument("name", choices=sorted(SERVICES))
    p.set_defaults(func=_cmd_service)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except SkedError as exc:
        print(f"sked: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
