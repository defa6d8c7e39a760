"""The `sked` commands: each takes its parsed arguments and returns the exit code.

The parser and the exit-code conventions are in services.cli; this module only acts and prints.
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
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

from services.cli import SERVICES
from services.cli.files import load_workflow
from services.cli.nodes import state_of
from services.cli.output import parse_task_id, print_id, print_json, workflow_json
from services.cli.remote import Client, connect
from shared import fsm
from shared.errors import SkedError
from shared.fsm import State
from shared.redact import for_terminal, printable

# What one command alone needs is imported in it: `sked status` must not pay for the
# migrations, the workflow models or the submit path (services.cli.command).
if TYPE_CHECKING:
    from shared.models import Task, TaskSpec
    from shared.views import WorkflowView

T = TypeVar("T")


# -- operate ---------------------------------------------------------------------------------


def _cmd_migrate(args: argparse.Namespace) -> int:
    from shared.settings import Settings
    from shared.store.migrate import migrate

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

    return run_dev(args.executors, args.slots, args.metrics_port)


# -- submit ----------------------------------------------------------------------------------


def spec_from_args(args: argparse.Namespace) -> TaskSpec:
    from shared.models import TaskSpec

    job: dict[str, Any]
    if args.command is not None:
        if args.args is not None:
            raise SkedError("--args goes with --handler: a command's arguments are in --command")
        try:
            argv = shlex.split(args.command)
        except ValueError as exc:  # an unclosed quote
            raise SkedError(f"--command: {exc}") from None
        job = {"kind": "command", "argv": argv}
        if args.image is not None:
            job["image"] = args.image
        default_name = Path(argv[0]).name if argv else "command"
    else:
        if args.image is not None:
            raise SkedError("--image goes with --command: a handler runs in the executor's image")
        try:
            job_args = json.loads(args.args) if args.args is not None else None
        except json.JSONDecodeError as exc:
            raise SkedError(f"--args is not JSON: {exc}") from None
        except RecursionError:
            raise SkedError("--args is nested too deep") from None
        job = {"kind": "handler", "handler": args.handler, "args": job_args}
        default_name = args.handler.replace(":", ".").rsplit(".", 1)[-1]
    data: dict[str, Any] = {
        "name": args.name or default_name,
        "job": job,
        "priority": args.priority,
        "max_retries": args.max_retries,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "resources": {"cpu": args.cpu, "memory_mb": args.memory, "gpu": args.gpu},
        "selector": _labels("--selector", args.selector),
        "affinity": _labels("--affinity", args.affinity),
    }
    if args.timeout is not None:
        data["timeout_s"] = args.timeout
    if args.schedule_timeout is not None:
        data["schedule_timeout_s"] = args.schedule_timeout
    if args.idempotency_key is not None:
        data["idempotency_key"] = args.idempotency_key
    return TaskSpec.parse(data)


def _labels(flag: str, given: list[str]) -> dict[str, str]:
    from shared.settings import parse_labels

    try:
        return parse_labels(",".join(given))
    except ValueError as exc:  # JSON's errors too
        raise SkedError(f"{flag}: {exc}") from None


async def _submit(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)

    def ended(task: Task) -> tuple[Any, str, bool]:
        summary = printable(f"{task.status.label}: {task.error or task.result}")
        return task.as_json(), summary, task.status is State.SUCCESS

    return await _submitted(args, lambda c: c.submit(spec), lambda c, i, t: c.wait(i, t), ended)


async def _submitted(
    args: argparse.Namespace,
    submit: Callable[[Client], Awaitable[UUID]],
    wait: Callable[[Client, UUID, float | None], Awaitable[T]],
    ended: Callable[[T], tuple[Any, str, bool]],
) -> int:
    """Submit and print the id; with --wait, wait and print how it ended: exit 0 only if it
    succeeded."""
    async with connect() as client:
        ident = await submit(client)
        if not args.wait:
            return print_id(ident, args.json)
        done = await wait(client, ident, args.wait_timeout)
    data, summary, ok = ended(done)
    if args.json:
        print_json(data)
    else:
        print(ident)
        print(summary)
    return 0 if ok else 1


# -- read ------------------------------------------------------------------------------------


async def _list(args: argparse.Namespace) -> int:
    after = None if args.after is None else parse_task_id(args.after)
    async with connect() as client:
        tasks = await client.tasks(args.status, args.limit, after, args.name)
    if args.json:
        print_json([t.as_json() for t in tasks])
        return 0
    for t in tasks:
        print(f"{t.id}  {t.status.label:<10}  {t.attempt:>3}  {t.priority:>5}  {printable(t.name)}")
    if len(tasks) == args.limit:  # on stderr: what a pipe reads stays the listing
        again = [f"--status {shlex.quote(s)}" for s in args.status or ()]
        if args.name is not None:
            again.append(f"--name {shlex.quote(args.name)}")
        again.append(f"--limit {args.limit}")
        print(f"more: sked list {' '.join(again)} --after {tasks[-1].id}", file=sys.stderr)
    return 0


async def _workflows(args: argparse.Namespace) -> int:
    after = None if args.after is None else parse_task_id(args.after, "workflow")
    async with connect() as client:
        found = await client.workflows(args.limit, after, args.name)
    if args.json:
        print_json([w.as_json() for w in found])
        return 0
    for w in found:
        counts = " ".join(f"{n} {State(s).label}" for s, n in sorted(w.counts.items()))
        when = f"{w.created_at:%Y-%m-%d %H:%M:%S}"
        print(f"{w.id}  {w.status():<9}  {when}  {printable(w.name)}  ({counts})")
    if len(found) == args.limit:  # on stderr: what a pipe reads stays the listing
        again = [] if args.name is None else [f"--name {shlex.quote(args.name)}"]
        again.append(f"--limit {args.limit}")
        print(f"more: sked workflows {' '.join(again)} --after {found[-1].id}", file=sys.stderr)
    return 0


async def _events(args: argparse.Namespace) -> int:
    async with connect() as client:
        events = await client.history(parse_task_id(args.id))
    if args.json:
        print_json([e.model_dump(mode="json") for e in events])
        return 0
    for e in events:
        source = e.from_status.label if e.from_status else "-"
        print(
            f"v{e.version:<3} {e.at.isoformat()}  attempt {e.attempt}  "
            f"{source} -> {e.to_status.label}  {printable(e.reason)}"
        )
    return 0


async def _logs(args: argparse.Namespace) -> int:
    async with connect() as client:
        task_id = parse_task_id(args.id)
        text = await client.log(task_id)
        if text is None or args.json:
            task = await client.get(task_id)
    if args.json:  # as GET /v1/tasks/{id}/logs answers
        print_json({"id": str(task_id), "status": task.status.value, "log": text})
    elif text is None:
        print(f"(no log yet: the task is {task.status.label})", file=sys.stderr)
    elif args.raw or not sys.stdout.isatty():
        sys.stdout.write(text)
    else:  # a task's escape sequences would act on the operator's terminal
        sys.stdout.write(for_terminal(text))
    return 0


async def _wait(args: argparse.Namespace) -> int:
    from shared.client import WaitTimeout

    ids = [parse_task_id(i) for i in args.ids]
    async with connect() as client:
        try:
            done = await client.wait_all(ids, args.timeout)
        except WaitTimeout as exc:
            print(f"sked: {printable(str(exc))}", file=sys.stderr)
            return 1
    failed = [t for t in done.values() if t.status is not State.SUCCESS]
    for t in failed:
        print(f"{t.id} {t.status.label}: {printable(t.error or t.status_reason)}", file=sys.stderr)
    return 1 if failed else 0


async def _control(args: argparse.Namespace) -> int:
    task_id = parse_task_id(args.id)
    async with connect() as client:
        if args.action == "pause":
            task = await client.pause(task_id, args.reason, args.by)
        elif args.action == "resume":
            task = await client.resume(task_id, args.by)
        else:
            task = await client.cancel(task_id, args.reason, args.by)
    if args.json:
        print_json(task.as_json())
    else:
        print(f"{task.id} {task.status.label}: {printable(task.status_reason)}")
    return 0


async def _workflow_control(args: argparse.Namespace) -> int:
    workflow_id = parse_task_id(args.id, "workflow")
    async with connect() as client:
        if args.action == "pause":
            moved = await client.pause_workflow(workflow_id, args.reason, args.by)
        elif args.action == "resume":
            moved = await client.resume_workflow(workflow_id, args.by)
        else:
            moved = await client.cancel_workflow(workflow_id, args.reason, args.by)
    if args.json:
        print_json([t.as_json() for t in moved])
        return 0
    for task in moved:
        print(f"{task.id} {printable(task.wf_task or task.name)}: {task.status.label}")
    done = {"pause": "paused", "resume": "resumed", "cancel": "canceled"}[args.action]
    print(f"{len(moved)} tasks of workflow {workflow_id} {done}", file=sys.stderr)
    return 0


async def _priority(args: argparse.Namespace) -> int:
    async with connect() as client:
        changed = await client.set_priority(parse_task_id(args.id), args.priority)
    if args.json:
        print_json([t.as_json() for t in changed])
        return 0
    for task in changed:
        own = task.spec.priority
        note = "" if own == task.priority else f" (own {own}, inherited from downstream)"
        print(f"{task.id} {printable(task.wf_task or task.name)}: priority {task.priority}{note}")
    return 0


async def _submit_workflow(args: argparse.Namespace) -> int:
    from shared.dag import WorkflowSpec

    spec = WorkflowSpec.parse(load_workflow(args.file))

    def ended(view: WorkflowView) -> tuple[Any, str, bool]:
        summary = f"{view.status()}: {view.counts()}"
        return workflow_json(view), summary, view.status() == "succeeded"

    return await _submitted(
        args, lambda c: c.submit_workflow(spec), lambda c, i, t: c.wait_workflow(i, t), ended
    )


async def _workflow(args: argparse.Namespace) -> int:
    async with connect() as client:
        view = await client.workflow(parse_task_id(args.id, "workflow"))
    if args.dot:
        sys.stdout.write(view.dot())
    elif args.json:
        print_json(workflow_json(view))
    else:
        print(f"workflow {view.id}  {printable(view.name)}  {view.status()}  {view.counts()}")
        for t in view.tasks:
            print(f"  {t.id}  {t.status.label:<10}  {printable(t.wf_task or '')}")
    return 0


async def _nodes(args: argparse.Namespace) -> int:
    async with connect() as client:
        nodes = await client.nodes()
    if args.json:
        print_json([n.as_json() for n in nodes])
        return 0
    for n in nodes:
        state = state_of(n)
        labels = ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())) or "-"
        # attempts dispatched there count against its slots plus the backlog it offers now
        backlog = f"+{n.prefetch} backlog" if n.prefetch else ""
        line = (
            f"{n.id:<20} {state:<8} slots {n.used_slots}/{n.slots}{backlog}"
            f"  cpu {n.used_cpu:g}/{n.cpu:g}"
            f"  mem {n.used_memory_mb}/{n.memory_mb}  gpu {n.used_gpu}/{n.gpu}  {labels}"
        )
        print(printable(line))  # labels are the cluster's or an operator's
    return 0


async def _dead(args: argparse.Namespace) -> int:
    async with connect() as client:
        letters = await client.dead_letters(args.limit)
    if args.json:
        print_json([d.as_json() for d in letters])
        return 0
    for d in letters:
        print(f"{printable(d.routing_key) or '-'}  {d.size} bytes  {printable(d.reason)}")
        print(f"    {printable(d.body)}{' ...' if d.size > len(d.body.encode()) else ''}")
    if not letters:
        print("sked.dead is empty", file=sys.stderr)
    return 0
