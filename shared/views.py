"""Read models the SDK and the CLI show: a workflow with its tasks and edges."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from uuid import UUID

from shared import fsm
from shared.fsm import State
from shared.models import Task


def is_done(task: Task) -> bool:
    return fsm.is_terminal(task.status, fsm.has_retry_left(task))


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
        """The aggregate: running until every task is terminal; then failed if any task
        failed or timed out, canceled if any was canceled, else succeeded."""
        if not all(is_done(t) for t in self.tasks):
            return "paused" if any(t.status is State.PAUSED for t in self.tasks) else "running"
        states = {t.status for t in self.tasks}
        if states & {State.FAILED, State.TIMED_OUT}:
            return "failed"
        if State.CANCELED in states:
            return "canceled"
        return "succeeded"

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
        names = {t.id: t.wf_task or t.name for t in self.tasks}
        lines = [f'digraph "{self.name}" {{', "  rankdir=LR;", "  node [style=filled];"]
        for t in self.tasks:
            colour = colours.get(t.status.value, "white")
            lines.append(
                f'  "{names[t.id]}" [label="{names[t.id]}\\n{t.status.label}", fillcolor={colour}];'
            )
        for upstream, downstream, condition in self.edges:
            label = "" if condition == "on_success" else f' [label="{condition}"]'
            lines.append(f'  "{names[upstream]}" -> "{names[downstream]}"{label};')
        lines.append("}")
        return "\n".join(lines) + "\n"
