"""Read models the SDK and the CLI show: a workflow with its tasks and edges, and a workflow
as a listing counts it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from shared import fsm
from shared.fsm import State
from shared.models import Task
from shared.redact import printable


def is_done(task: Task) -> bool:
    return fsm.is_terminal(task.status, fsm.has_retry_left(task))


def aggregate(open_tasks: bool, states: set[State]) -> str:
    """A workflow's status from its tasks: running until every task is terminal (paused if one
    is paused); then failed if any task failed or timed out, canceled if any was canceled,
    else succeeded."""
    if open_tasks:
        return "paused" if State.PAUSED in states else "running"
    if states & {State.FAILED, State.TIMED_OUT}:
        return "failed"
    if State.CANCELED in states:
        return "canceled"
    return "succeeded"


@dataclass(frozen=True)
class WorkflowSummary:
    """A workflow as a listing shows it: its tasks counted by state, not read."""

    id: UUID
    name: str
    created_at: datetime
    counts: dict[str, int]
    open: int  # tasks not ended yet

    def __post_init__(self) -> None:
        for state in self.counts:  # a state each (an answer of the API is read into this)
            State(state)

    def status(self) -> str:
        return aggregate(self.open > 0, {State(s) for s in self.counts})

    def as_json(self) -> dict[str, Any]:
        return {
            "id": str(self.id),
            "name": self.name,
            "created_at": self.created_at.isoformat(),
            "status": self.status(),
            "counts": self.counts,
            "open": self.open,
        }


@dataclass(frozen=True)
class WorkflowView:
    """A workflow as stored: its tasks and edges (upstream, downstream, condition)."""

    id: UUID
    name: str
    tasks: list[Task]
    edges: list[tuple[UUID, UUID, str]]

    def counts(self) -> dict[str, int]:
        return dict(Counter(t.status.value for t in self.tasks))

    def status(self) -> str:
        return aggregate(any(not is_done(t) for t in self.tasks), {t.status for t in self.tasks})

    def dot(self) -> str:
        """The DAG in Graphviz DOT, each node labelled with its name and state."""
        colours = {
            "success": "palegreen",
            "failed": "salmon",
            "timed_out": "salmon",
            "running": "lightblue",
            "skipped": "lightgrey",
            "canceled": "lightgrey",
            "paused": "khaki",
        }
        # names are producers': quoted for DOT (a " in one could add statements) and inert
        names = {t.id: _dot(t.wf_task or t.name) for t in self.tasks}
        lines = [f'digraph "{_dot(self.name)}" {{', "  rankdir=LR;", "  node [style=filled];"]
        for t in self.tasks:
            colour = colours.get(t.status.value, "white")
            lines.append(
                f'  "{names[t.id]}" [label="{names[t.id]}\\n{t.status.label}", fillcolor={colour}];'
            )
        for upstream, downstream, condition in self.edges:
            label = "" if condition == "on_success" else f' [label="{_dot(condition)}"]'
            lines.append(f'  "{names[upstream]}" -> "{names[downstream]}"{label};')
        lines.append("}")
        return "\n".join(lines) + "\n"


def _dot(text: str) -> str:
    """`text` inside a DOT double-quoted string: backslashes and quotes escaped, and what a
    terminal would act on written as its escape."""
    return printable(text).replace("\\", "\\\\").replace('"', '\\"')
