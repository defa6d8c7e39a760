"""The `sked` command line: operate a deployment, run its services, submit and inspect tasks.

Every command reads the deployment from `SKED_*` variables (shared.settings), like the services;
with SKED_API_URL and SKED_API_TOKEN set, the read and control commands (and `sked node`) go
through the operator API instead of the database.
Read commands take `--json`. Exit codes: 0 ok, 1 a task did not succeed / check failed,
2 a usage or input error (the message says which).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Callable
from typing import Any

from services.cli import degrade, nodes, tokens
from services.cli.output import seconds
from shared.errors import NotAllowed, SkedError, postgres_said, rabbitmq_said
from shared.redact import masked, printable

# `sked service NAME`: the module whose run(argv) is that service's main.
SERVICES: dict[str, str] = {
    "scheduler": "services.scheduler.__main__",
    "executor": "services.executor.__main__",
    "relay": "services.relay.__main__",
    "heartbeat-monitor": "services.heartbeat_monitor.__main__",
    "recovery": "services.recovery.__main__",
    "api": "services.api.__main__",
}

Command = Callable[[argparse.Namespace], int]


def command(name: str, is_async: bool = True, module: str = "services.cli.commands") -> Command:
    """`module`'s `name`, imported only when the command runs: parsing imports nothing heavy,
    and each command imports only what it uses (`sked status` needs neither RabbitMQ nor
    tracing, nor asyncio when libpq is there). An async command runs on a fresh event loop."""

    def call(args: argparse.Namespace) -> int:
        func = getattr(importlib.import_module(module), name)
        if not is_async:
            code: int = func(args)
            return code
        from services.cli.output import run

        done: int = run(func(args))
        return done

    return call


# -- parser ----------------------------------------------------------------------------------


def _page_size(text: str) -> int:
    """A listing's --limit: the operator API's bounds (services.api.tasks.MAX_LIST)."""
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 1000:
        raise argparse.ArgumentTypeError(f"an integer from 1 to 1000: {text!r}")
    return int(text)


def _reader(sub: Any, name: str, text: str, func: Command) -> argparse.ArgumentParser:
    """A command about one task or workflow by id, with --json."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=text)
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sked", description=__doc__)
    sub = parser.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", help="create the database if needed and apply migrations")
    p.set_defaults(func=command("_cmd_migrate", is_async=False))

    p = sub.add_parser("diagram", help="print the FSM as Mermaid, or write it into the docs")
    p.add_argument("--doc", default="docs/architecture.md")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the diagram in --doc")
    mode.add_argument("--check", action="store_true", help="exit 1 if --doc is out of date")
    p.set_defaults(func=command("_cmd_diagram", is_async=False))

    p = sub.add_parser("service", help="run one sked service in the foreground")
    p.add_argument("name", choices=sorted(SERVICES))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the service's own flags")
    p.set_defaults(func=command("_cmd_service", is_async=False))

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
    p.set_defaults(func=command("_cmd_dev", is_async=False))

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
    p.add_argument(
        "--affinity",
        action="append",
        default=[],
        metavar="K=V",
        help="a node label preferred, not required",
    )
    p.add_argument("--idempotency-key")
    p.add_argument("--wait", action="store_true", help="wait for a terminal state")
    p.add_argument("--wait-timeout", type=seconds, help="with --wait: give up after SECONDS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=command("_submit"))

    p = sub.add_parser("submit-workflow", help="submit a workflow file (YAML or JSON)")
    p.add_argument("file")
    p.add_argument("--wait", action="store_true", help="wait until every task is terminal")
    p.add_argument("--wait-timeout", type=seconds, help="with --wait: give up after SECONDS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=command("_submit_workflow"))

    p = _reader(
        sub, "workflow", "a workflow's status, its tasks, or its DAG (--dot)", command("_workflow")
    )
    p.add_argument("--dot", action="store_true", help="the DAG in Graphviz DOT, with states")
    text = "one task: status, attempt, node, result, error, reason"
    _reader(sub, "status", text, command("status", False, "services.cli.status"))

    p = sub.add_parser("list", help="tasks, newest first")
    p.add_argument("--status", action="append", help="filter by state (repeatable)")
    p.add_argument("--name", help="only tasks of this name")
    p.add_argument("--limit", type=_page_size, default=50, help="at most (1 to 1000; 50)")
    p.add_argument("--after", metavar="ID", help="the next page: the tasks after this one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=command("_list"))

    p = sub.add_parser("workflows", help="workflows, newest first, with their status")
    p.add_argument("--name", help="only workflows of this name")
    p.add_argument("--limit", type=_page_size, default=50, help="at most (1 to 1000; 50)")
    p.add_argument("--after", metavar="ID", help="the next page: the workflows after this one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=command("_workflows"))

    _reader(sub, "events", "a task's transition history", command("_events"))

    p = sub.add_parser("logs", help="the log tail of a task's latest attempt")
    p.add_argument("id")
    p.add_argument("--json", action="store_true", help="its id, state and log (null: none yet)")
    p.add_argument(
        "--raw",
        action="store_true",
        help="on a terminal too, the log as it is (else its controls but line breaks and tabs"
        " are written as escapes)",
    )
    p.set_defaults(func=command("_logs"))

    p = sub.add_parser("wait", help="wait for tasks; exit 0 only if all succeeded")
    p.add_argument("ids", nargs="+", metavar="ID")
    p.add_argument("--timeout", type=seconds, help="give up after SECONDS")
    p.set_defaults(func=command("_wait"))

    controls = (  # an action, on one task and on a whole workflow
        (
            "pause",
            "pause a task (a running attempt is stopped; no retry is spent)",
            "pause every task of a workflow that has not ended",
        ),
        (
            "resume",
            "resume a paused task: it runs again as a new attempt",
            "resume every paused task of a workflow",
        ),
        (
            "cancel",
            "cancel a task (a running attempt is stopped)",
            "cancel every task of a workflow that has not ended",
        ),
    )
    for action, one, whole in controls:
        for name, text, run in (
            (action, one, "_control"),
            (f"{action}-workflow", whole, "_workflow_control"),
        ):
            p = sub.add_parser(name, help=text)
            p.add_argument("id")
            if action != "resume":
                p.add_argument("--reason", default="", required=action == "pause")
            p.add_argument("--by", help="who is acting (default: user@host)")
            p.add_argument("--json", action="store_true")
            p.set_defaults(func=command(run), action=action)

    p = sub.add_parser(
        "priority", help="change a task's priority (a workflow task's upstreams inherit it)"
    )
    p.add_argument("id")
    p.add_argument("priority", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=command("_priority"))

    p = sub.add_parser("nodes", help="registered executors, their capacity and usage")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=command("_nodes"))

    p = sub.add_parser("dead", help="refused submissions (sked.dead), oldest first, with why")
    p.add_argument("--limit", type=_page_size, default=20, help="at most (1 to 1000; 20)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=command("_dead"))

    degrade.add_parser(sub)
    nodes.add_parser(sub)
    tokens.add_parser(sub)
    return parser


def _not_allowed(exc: SkedError) -> bool:
    """A well-formed request the task's state refuses (shared.errors.NotAllowed): exit 1,
    not 2."""
    return isinstance(exc, NotAllowed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Command = args.func
    # what a library says may quote the URL it was given: no password is printed
    try:
        return func(args)
    except SkedError as exc:
        print(f"sked: {printable(masked(str(exc)))}", file=sys.stderr)
        return 1 if _not_allowed(exc) else 2
    except OSError as exc:  # a server not there (refused, unresolvable), a file not readable
        # a timeout's text is empty: "sked: " alone told the operator nothing
        said = str(exc) or ("timed out" if isinstance(exc, TimeoutError) else repr(exc))
        print(f"sked: {printable(masked(said))}", file=sys.stderr)
        return 2
    except Exception as exc:
        postgres, rabbitmq = postgres_said(exc), rabbitmq_said(exc)
        if postgres is None and rabbitmq is None:
            print(masked(traceback.format_exc()), end="", file=sys.stderr)
            return 2
        server = f"Postgres: {postgres}" if postgres is not None else f"RabbitMQ: {rabbitmq}"
        print(f"sked: {printable(masked(server))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
