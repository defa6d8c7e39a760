"""The `sked` command line: operate a deployment, run its services, submit and inspect tasks.

Every command reads the deployment from `SKED_*` variables (shared.settings), like the services.
Read commands take `--json`. Exit codes: 0 ok, 1 a task did not succeed / check failed,
2 a usage or input error (the message says which).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from uuid import UUID

from shared import fsm
from shared.client import SkedClient, WaitTimeout, WorkflowView
from shared.control import NotAllowed
from shared.dag import WorkflowSpec
from shared.errors import SkedError
from shared.fsm import State
from shared.models import Task, TaskSpec
from shared.settings import Settings, parse_labels
from shared.store.migrate import migrate

SERVICES: dict[str, str] = {
    "scheduler": "services.scheduler.__main__",
    "executor": "services.executor.__main__",
    "relay": "services.relay.__main__",
    "heartbeat-monitor": "services.heartbeat_monitor.__main__",
    "recovery": "services.recovery.__main__",
}


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def _print_id(ident: UUID, as_json: bool) -> int:
    if as_json:
        _print_json({"id": str(ident)})
    else:
        print(ident)
    return 0


def _task_id(text: str) -> UUID:
    try:
        return UUID(text)
    except ValueError:
        raise SkedError(f"not a task id: {text!r}") from None


def _run(coro: Awaitable[int]) -> int:
    return asyncio.run(coro)  # type: ignore[arg-type]


# -- operate ---------------------------------------------------------------------------------


def _cmd_migrate(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    version = asyncio.run(migrate(Settings().database_url))
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
    code: int = module.run(args.args)
    return code


def _cmd_dev(args: argparse.Namespace) -> int:
    from services.dev import run_dev

    return run_dev(args.executors, args.slots)


# -- submit ----------------------------------------------------------------------------------


def spec_from_args(args: argparse.Namespace) -> TaskSpec:
    job: dict[str, Any]
    if args.command is not None:
        argv = shlex.split(args.command)
        job = {"kind": "command", "argv": argv}
        default_name = Path(argv[0]).name if argv else "command"
    else:
        try:
            job_args = json.loads(args.args) if args.args is not None else None
        except json.JSONDecodeError as exc:
            raise SkedError(f"--args is not JSON: {exc}") from None
        job = {"kind": "handler", "handler": args.handler, "args": job_args}
        default_name = args.handler.replace(":", ".").rsplit(".", 1)[-1]
    data: dict[str, Any] = {
        "name": args.name or default_name,
        "job": job,
        "priority": args.priority,
        "max_retries": args.max_retries,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "resources": {"cpu": args.cpu, "memory_mb": args.memory, "gpu": args.gpu},
        "selector": parse_labels(",".join(args.selector)) if args.selector else {},
    }
    if args.timeout is not None:
        data["timeout_s"] = args.timeout
    if args.idempotency_key is not None:
        data["idempotency_key"] = args.idempotency_key
    return TaskSpec.parse(data)


async def _submit(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    async with SkedClient() as client:
        task_id = await client.submit(spec)
        if not args.wait:
            return _print_id(task_id, args.json)
        task = await client.wait(task_id, args.wait_timeout)
    if args.json:
        _print_json(task.as_json())
    else:
        print(task_id)
        print(f"{task.status.label}: {task.error or task.result}")
    return 0 if task.status is State.SUCCESS else 1


# -- read ------------------------------------------------------------------------------------


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _status_lines(task: Task) -> list[str]:
    lines = [
        f"id:        {task.id}",
        f"name:      {task.name}",
        f"status:    {task.status.label}",
        f"reason:    {task.status_reason}",
        f"attempt:   {task.attempt} (retries {task.retry_count}/{task.max_retries})",
        f"version:   {task.version}",
        f"priority:  {task.priority}"
        + (
            "" if task.spec.priority == task.priority else f" (own {task.spec.priority}, inherited)"
        ),
        f"node:      {task.node or '-'}",
        f"result:    {json.dumps(task.result)}",
        f"error:     {task.error or '-'}",
    ]
    if task.workflow_id is not None:
        lines.append(f"workflow:  {task.workflow_id} (task {task.wf_task})")
        if task.inputs is not None:
            lines.append(f"inputs:    {_clip(json.dumps(task.inputs), 500)}")
    if task.next_retry_at is not None and task.status is State.RETRY_WAIT:
        lines.append(f"retry at:  {task.next_retry_at.isoformat()}")
    if task.paused_at is not None:
        label = "paused:   " if task.status is State.PAUSED else "last paused:"
        lines.append(
            f"{label} by {task.paused_by} at {task.paused_at.isoformat()}: {task.paused_reason}"
        )
    return lines


async def _status(args: argparse.Namespace) -> int:
    async with SkedClient() as client:
        task = await client.get(_task_id(args.id))
    if args.json:
        _print_json(task.as_json())
    else:
        print("\n".join(_status_lines(task)))
    return 0


async def _list(args: argparse.Namespace) -> int:
    async with SkedClient() as client:
        tasks = await client.tasks(statuses=args.status, limit=args.limit)
    if args.json:
        _print_json([t.as_json() for t in tasks])
        return 0
    for t in tasks:
        print(f"{t.id}  {t.status.label:<10}  {t.attempt:>3}  {t.priority:>5}  {t.name}")
    return 0


async def _events(args: argparse.Namespace) -> int:
    async with SkedClient() as client:
        events = await client.history(_task_id(args.id))
    if args.json:
        _print_json([e.model_dump(mode="json") for e in events])
        return 0
    for e in events:
        source = e.from_status.label if e.from_status else "-"
        print(
            f"v{e.version:<3} {e.at.isoformat()}  attempt {e.attempt}  "
            f"{source} -> {e.to_status.label}  {e.reason}"
        )
    return 0


async def _logs(args: argparse.Namespace) -> int:
    async with SkedClient() as client:
        task = await client.get(_task_id(args.id))
    if task.log_tail is None:
        print(f"(no log yet: the task is {task.status.label})", file=sys.stderr)
        return 0
    sys.stdout.write(task.log_tail)
    return 0


async def _wait(args: argparse.Namespace) -> int:
    ids = [_task_id(i) for i in args.ids]
    async with SkedClient() as client:
        try:
            done = await client.wait_all(ids, args.timeout)
        except WaitTimeout as exc:
            print(f"sked: {exc}", file=sys.stderr)
            return 1
    failed = [t for t in done.values() if t.status is not State.SUCCESS]
    for t in failed:
        print(f"{t.id} {t.status.label}: {t.error or t.status_reason}", file=sys.stderr)
    return 1 if failed else 0


async def _control(args: argparse.Namespace) -> int:
    task_id = _task_id(args.id)
    async with SkedClient() as client:
        if args.action == "pause":
            task = await client.pause(task_id, args.reason, args.by)
        elif args.action == "resume":
            task = await client.resume(task_id)
        else:
            task = await client.cancel(task_id, args.reason, args.by)
    if args.json:
        _print_json(task.as_json())
    else:
        print(f"{task.id} {task.status.label}: {task.status_reason}")
    return 0


async def _priority(args: argparse.Namespace) -> int:
    async with SkedClient() as client:
        changed = await client.set_priority(_task_id(args.id), args.priority)
    if args.json:
        _print_json([t.as_json() for t in changed])
        return 0
    for task in changed:
        own = task.spec.priority
        note = "" if own == task.priority else f" (own {own}, inherited from downstream)"
        print(f"{task.id} {task.wf_task or task.name}: priority {task.priority}{note}")
    return 0


def _load_workflow(path: str) -> Any:
    import yaml  # YAML is a superset of JSON: one loader reads both

    try:
        text = Path(path).read_text("utf-8")
    except OSError as exc:
        raise SkedError(f"cannot read {path}: {exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SkedError(f"{path} is not YAML or JSON: {exc}") from None


def _workflow_json(view: WorkflowView) -> dict[str, Any]:
    return {
        "id": str(view.id),
        "name": view.name,
        "status": view.status(),
        "counts": view.counts(),
        "tasks": [
            {"id": str(t.id), "name": t.wf_task, "status": t.status.value, "attempt": t.attempt}
            for t in view.tasks
        ],
    }


async def _submit_workflow(args: argparse.Namespace) -> int:
    spec = WorkflowSpec.parse(_load_workflow(args.file))
    async with SkedClient() as client:
        workflow_id = await client.submit_workflow(spec)
        if not args.wait:
            return _print_id(workflow_id, args.json)
        view = await client.wait_workflow(workflow_id, args.wait_timeout)
    if args.json:
        _print_json(_workflow_json(view))
    else:
        print(workflow_id)
        print(f"{view.status()}: {view.counts()}")
    return 0 if view.status() == "succeeded" else 1


async def _workflow(args: argparse.Namespace) -> int:
    async with SkedClient() as client:
        view = await client.workflow(_task_id(args.id))
    if args.dot:
        sys.stdout.write(view.dot())
    elif args.json:
        _print_json(_workflow_json(view))
    else:
        print(f"workflow {view.id}  {view.name}  {view.status()}  {view.counts()}")
        for t in view.tasks:
            print(f"  {t.id}  {t.status.label:<10}  {t.wf_task}")
    return 0


async def _nodes(args: argparse.Namespace) -> int:
    async with SkedClient() as client:
        nodes = await client.nodes()
    if args.json:
        _print_json([n.as_json() for n in nodes])
        return 0
    for n in nodes:
        state = "ready" if n.ready and n.live else ("gone" if not n.live else "draining")
        labels = ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())) or "-"
        print(
            f"{n.id:<20} {state:<8} slots {n.used_slots}/{n.slots}  cpu {n.used_cpu:g}/{n.cpu:g}"
            f"  mem {n.used_memory_mb}/{n.memory_mb}  gpu {n.used_gpu}/{n.gpu}  {labels}"
        )
    return 0


# -- parser ----------------------------------------------------------------------------------


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
    p.set_defaults(func=_cmd_dev)

    p = sub.add_parser("submit", help="submit one task; prints its id")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--command", help='the command line to run, e.g. "python job.py --x 1"')
    what.add_argument("--handler", help="a Python callable, module:function")
    p.add_argument("--args", help="JSON arguments for --handler")
    p.add_argument("--name")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--max-retries", type=int, default=0)
    p.add_argument("--timeout", type=float, help="run timeout in seconds")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0)
    p.add_argument("--cpu", type=float, default=0.0)
    p.add_argument("--memory", type=int, default=0, help="memory in MB")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--selector", action="append", default=[], metavar="K=V")
    p.add_argument("--idempotency-key")
    p.add_argument("--wait", action="store_true", help="wait for a terminal state")
    p.add_argument("--wait-timeout", type=float, help="with --wait: give up after SECONDS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: _run(_submit(a)))

    p = sub.add_parser("submit-workflow", help="submit a workflow file (YAML or JSON)")
    p.add_argument("file")
    p.add_argument("--wait", action="store_true", help="wait until every task is terminal")
    p.add_argument("--wait-timeout", type=float)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: _run(_submit_workflow(a)))

    p = sub.add_parser("workflow", help="a workflow's status, its tasks, or its DAG (--dot)")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dot", action="store_true", help="the DAG in Graphviz DOT, with states")
    p.set_defaults(func=lambda a: _run(_workflow(a)))

    p = sub.add_parser("status", help="one task: status, attempt, node, result, error, reason")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: _run(_status(a)))

    p = sub.add_parser("list", help="tasks, newest first")
    p.add_argument("--status", action="append", help="filter by state (repeatable)")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: _run(_list(a)))

    p = sub.add_parser("events", help="a task's transition history")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: _run(_events(a)))

    p = sub.add_parser("logs", help="the log tail of a task's latest attempt")
    p.add_argument("id")
    p.set_defaults(func=lambda a: _run(_logs(a)))

    p = sub.add_parser("wait", help="wait for tasks; exit 0 only if all succeeded")
    p.add_argument("ids", nargs="+", metavar="ID")
    p.add_argument("--timeout", type=float)
    p.set_defaults(func=lambda a: _run(_wait(a)))

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
        p.set_defaults(func=lambda a: _run(_control(a)), action=action)

    p = sub.add_parser(
        "priority", help="change a task's priority (a workflow task's upstreams inherit it)"
    )
    p.add_argument("id")
    p.add_argument("priority", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: _run(_priority(a)))

    p = sub.add_parser("nodes", help="registered executors, their capacity and usage")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: _run(_nodes(a)))
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
