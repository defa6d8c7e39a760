"""The `sked` command line: operate a deployment, run its services, submit and inspect tasks.

Every command reads the deployment from `SKED_*` variables (shared.settings), like the services;
with SKED_API_URL and SKED_API_TOKEN set, the read and control commands (and `sked node`) go
through the operator API instead of the database.
Read commands take `--json`. Exit codes: 0 ok, 1 a task did not succeed / check failed,
2 a usage or input error (the message says which).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from services.cli import degrade, nodes, tokens
from services.cli.commands import (
    SERVICES,
    _cmd_dev,
    _cmd_diagram,
    _cmd_migrate,
    _cmd_service,
    _control,
    _events,
    _list,
    _logs,
    _nodes,
    _priority,
    _status,
    _submit,
    _submit_workflow,
    _wait,
    _workflow,
)
from services.cli.output import run
from shared.control import NotAllowed
from shared.errors import SkedError

# -- parser ----------------------------------------------------------------------------------


def _reader(
    sub: Any, name: str, text: str, command: Callable[[argparse.Namespace], Awaitable[int]]
) -> argparse.ArgumentParser:
    """A command about one task or workflow by id, with --json."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=text)
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(command(a)))
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sked", description=__doc__)
    sub = parser.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

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
    p.add_argument("args", nargs=argparse.REMAINDER, help="the service's own flags")
    p.set_defaults(func=_cmd_service)

    p = sub.add_parser("dev", help="run scheduler, relay and executors in the foreground")
    p.add_argument("--executors", type=int, default=2, help="how many executors (default 2)")
    p.add_argument("--slots", type=int, default=4, help="slots per executor (default 4)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9464,
        help="GET /metrics of the i-th process on this port + i (default 9464; 0: any free "
        "ports, logged; -1: off)",
    )
    p.set_defaults(func=_cmd_dev)

    p = sub.add_parser("submit", help="submit one task; prints its id")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--command", help='the command line to run, e.g. "python job.py --x 1"')
    what.add_argument("--handler", help="a Python callable, module:function")
    p.add_argument("--args", help="JSON arguments for --handler")
    p.add_argument(
        "--image", help="with --command: its container image (the Kubernetes backend needs one)"
    )
    p.add_argument("--name")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--max-retries", type=int, default=0)
    p.add_argument("--timeout", type=float, help="run timeout in seconds")
    p.add_argument(
        "--schedule-timeout",
        type=float,
        metavar="SECONDS",
        help="fail the task (no retry) if it has not started this long after becoming Ready",
    )
    p.add_argument("--heartbeat-timeout", type=float, default=30.0)
    p.add_argument("--cpu", type=float, default=0.0)
    p.add_argument("--memory", type=int, default=0, help="memory in MB")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--selector", action="append", default=[], metavar="K=V")
    p.add_argument("--idempotency-key")
    p.add_argument("--wait", action="store_true", help="wait for a terminal state")
    p.add_argument("--wait-timeout", type=float, help="with --wait: give up after SECONDS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_submit(a)))

    p = sub.add_parser("submit-workflow", help="submit a workflow file (YAML or JSON)")
    p.add_argument("file")
    p.add_argument("--wait", action="store_true", help="wait until every task is terminal")
    p.add_argument("--wait-timeout", type=float)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_submit_workflow(a)))

    p = _reader(sub, "workflow", "a workflow's status, its tasks, or its DAG (--dot)", _workflow)
    p.add_argument("--dot", action="store_true", help="the DAG in Graphviz DOT, with states")
    _reader(sub, "status", "one task: status, attempt, node, result, error, reason", _status)

    p = sub.add_parser("list", help="tasks, newest first")
    p.add_argument("--status", action="append", help="filter by state (repeatable)")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_list(a)))

    _reader(sub, "events", "a task's transition history", _events)

    p = sub.add_parser("logs", help="the log tail of a task's latest attempt")
    p.add_argument("id")
    p.set_defaults(func=lambda a: run(_logs(a)))

    p = sub.add_parser("wait", help="wait for tasks; exit 0 only if all succeeded")
    p.add_argument("ids", nargs="+", metavar="ID")
    p.add_argument("--timeout", type=float)
    p.set_defaults(func=lambda a: run(_wait(a)))

    for action, text in (
        ("pause", "pause a task (a running attempt is stopped; no retry is spent)"),
        ("resume", "resume a paused task: it runs again as a new attempt"),
        ("cancel", "cancel a task (a running attempt is stopped)"),
    ):
        p = sub.add_parser(action, help=text)
        p.add_argument("id")
        if action != "resume":
            p.add_argument("--reason", default="", required=action == "pause")
            p.add_argument("--by", help="who is acting (default: user@host)")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=lambda a: run(_control(a)), action=action)

    p = sub.add_parser(
        "priority", help="change a task's priority (a workflow task's upstreams inherit it)"
    )
    p.add_argument("id")
    p.add_argument("priority", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_priority(a)))

    p = sub.add_parser("nodes", help="registered executors, their capacity and usage")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_nodes(a)))

    degrade.add_parser(sub)
    nodes.add_parser(sub)
    tokens.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except NotAllowed as exc:  # a well-formed request the task's state refuses
        print(f"sked: {exc}", file=sys.stderr)
        return 1
    except SkedError as exc:
        print(f"sked: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
