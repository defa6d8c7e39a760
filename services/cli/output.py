"""How the `sked` command shows things: JSON for `--json`, lines for people."""

from __future__ import annotations

import json
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

from shared.errors import SkedError
from shared.fsm import State
from shared.redact import printable

if TYPE_CHECKING:  # annotations only: importing these (pydantic models) is the caller's cost
    from shared.models import Task
    from shared.views import WorkflowView


T = TypeVar("T")


def seconds(text: str) -> float:
    """A how-long-to-wait argument: a finite number of seconds, 0 or more. (NaN would wait
    forever: no deadline compares past it.)"""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"a number of seconds, 0 or more: {text!r}")
    return value


def print_json(value: Any) -> None:
    """JSON, strictly: NaN or Infinity (which no JSON reader takes) is refused, not printed."""
    try:
        text = json.dumps(value, indent=2, default=str, allow_nan=False)
    except ValueError as exc:
        raise SkedError(f"cannot print as JSON: {exc}") from None
    print(text)


def print_id(ident: UUID, as_json: bool) -> int:
    if as_json:
        print_json({"id": str(ident)})
    else:
        print(ident)
    return 0


def parse_task_id(text: str, what: str = "task") -> UUID:
    try:
        return UUID(text)
    except ValueError:
        raise SkedError(f"not a {what} id: {text!r}") from None


def run(coro: Coroutine[Any, Any, T]) -> T:
    import asyncio  # here, not above: `sked status` may answer without it

    return asyncio.run(coro)


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def status_lines(task: Task) -> list[str]:
    lines = [
        f"id:        {task.id}",
        f"name:      {task.name}",
        f"status:    {task.status.label}",
        f"reason:    {task.status_reason}",
        f"attempt:   {task.attempt} (retries {task.retry_count}/{task.max_retries})",
        f"version:   {task.version}",
        f"priority:  {task.priority}"
        + ("" if task.own_priority == task.priority else f" (own {task.own_priority}, inherited)"),
        f"node:      {task.node or '-'}",
        f"result:    {json.dumps(task.result)}",
        f"error:     {task.error or '-'}",
    ]
    if task.workflow_id is not None:
        lines.append(f"workflow:  {task.workflow_id} (task {task.wf_task})")
        if task.inputs is not None:
            lines.append(f"inputs:    {clip(json.dumps(task.inputs), 500)}")
    if task.next_retry_at is not None and task.status is State.RETRY_WAIT:
        lines.append(f"retry at:  {task.next_retry_at.isoformat()}")
    if task.paused_at is not None:
        label = "paused:   " if task.status is State.PAUSED else "last paused:"
        lines.append(
            f"{label} by {task.paused_by} at {task.paused_at.isoformat()}: {task.paused_reason}"
        )
    # names, reasons and errors come from producers, operators and tasks' own output: a
    # terminal escape or line break among them is shown, not acted on
    return [printable(line) for line in lines]


def workflow_json(view: WorkflowView) -> dict[str, Any]:
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
