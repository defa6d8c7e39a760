"""A task as stored: a plain dataclass, free of pydantic (shared.models re-exports it), so
that reading a task — `sked status` — loads neither pydantic nor the spec's models."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any
from uuid import UUID

from shared.fsm import State

if TYPE_CHECKING:
    from shared.models import TaskSpec


@dataclass(frozen=True)
class Task:
    """A task as stored: the spec plus its lifecycle columns.

    A plain dataclass rather than a pydantic model: rows come from our own schema, and
    validating every returned row cost more CPU than the SQL that moved it (docs/performance.md).
    The spec is kept as the stored JSON text and parsed on first use.
    """

    id: UUID
    name: str
    kind: str
    spec_json: str
    status: State
    status_reason: str
    version: int
    attempt: int
    priority: int
    retry_count: int
    max_retries: int
    next_retry_at: datetime | None
    timeout_s: float | None
    heartbeat_timeout_s: float
    node: str | None
    idempotency_key: str | None
    paused_by: str | None
    paused_reason: str | None
    paused_at: datetime | None
    result: Any
    error: str | None
    created_at: datetime
    updated_at: datetime
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    log_tail: str | None
    cpu: float
    memory_mb: int
    gpu: int
    traceparent: str | None
    hb_at: datetime | None
    hb_deadline: datetime | None
    hb_seq: int
    workflow_id: UUID | None
    wf_task: str | None
    uses: list[str]
    # a workflow task's inputs from its upstreams, fixed at release; None outside workflows
    inputs: Any = None
    # the attempt whose process may be alive, its executor incarnation, and until when
    lease_owner: UUID | None = None
    lease_attempt: int | None = None
    lease_until: datetime | None = None
    # the spec's schedule_timeout_s, and when it runs out (Postgres time; kept while the task
    # bounces between Ready and Scheduling, set anew when it enters Ready from a waiting state)
    schedule_timeout_s: float | None = None
    schedule_deadline: datetime | None = None
    # attempts that never started, and how many may (TaskSpec.max_launch_failures)
    launch_failures: int = 0
    max_launch_failures: int = 3

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Task:
        """A task from a row of its columns (other keys are ignored).

        Filled in directly rather than through the generated __init__: a frozen dataclass of
        45 fields sets each through object.__setattr__, ~49 µs a row against ~6 µs here (a loop
        over the row's keys; zipping its keys with its values halves that again) —
        and every statement that moves tasks returns their rows (docs/performance.md)."""
        task = object.__new__(cls)
        values = task.__dict__
        values.update(_TASK_DEFAULTS)
        values.update(zip(row.keys(), row.values(), strict=True))  # C-level, not a loop
        if len(values) != len(_TASK_FIELDS) or not _TASK_FIELDS.issuperset(values):
            # a statement's own columns beside the task's, or some of the task's missing
            for key in values.keys() - _TASK_FIELDS:
                del values[key]
            if len(values) != len(_TASK_FIELDS):
                missing = sorted(_TASK_FIELDS - values.keys())
                raise TypeError(f"a task row lacks the columns {missing}")
        values["status"] = State(values["status"])
        return task

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> list[Task]:
        """`from_row` for the rows of one statement, which share their columns: the columns
        are read and checked once, and each row's values zipped with them (~4 µs a row
        against ~7). Rows lacking some of a task's columns go through `from_row`."""
        if not rows:
            return []
        keys = tuple(rows[0].keys())
        extra = [key for key in keys if key not in _TASK_FIELDS]  # a statement's own columns
        if len(keys) - len(extra) != len(_TASK_FIELDS):
            return [cls.from_row(row) for row in rows]
        new, states, out = object.__new__, _STATES, []
        for row in rows:
            task = new(cls)
            values = task.__dict__
            values.update(zip(keys, row.values(), strict=True))
            for key in extra:
                del values[key]
            status = values["status"]
            values["status"] = states.get(status) or State(status)
            out.append(task)
        return out

    @cached_property
    def spec(self) -> TaskSpec:
        from shared.models import TaskSpec  # pydantic: loaded by the first reader of a spec

        return TaskSpec.model_validate_json(self.spec_json)

    def labels(self) -> tuple[dict[str, str], dict[str, str]]:
        """The spec's selector and affinity. Placement reads them for every task it places:
        from the stored JSON (validated when the task was admitted), not through the spec's
        models, which cost twice the parse; the resources are columns of their own."""
        spec = self.__dict__.get("spec")  # already built by an earlier reader
        if spec is not None:
            return spec.selector, spec.affinity
        from pydantic_core import from_json  # here: `sked status` reads tasks without it

        data = from_json(self.spec_json)  # pydantic's parser: a third of json.loads's cost
        return data.get("selector") or {}, data.get("affinity") or {}

    @property
    def own_priority(self) -> int:
        """The priority its spec asked for (a workflow's task may inherit a higher one), read
        from the stored spec without building it: every stored spec names its priority."""
        return int(json.loads(self.spec_json)["priority"])

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict (for `--json` output and HTTP answers)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "spec_json":
                out["spec"] = json.loads(value)
            elif isinstance(value, datetime):
                out[f.name] = value.isoformat()
            elif isinstance(value, UUID | State):
                out[f.name] = str(value)
            else:
                out[f.name] = value
        return out


_TASK_FIELDS = frozenset(f.name for f in fields(Task))
_TASK_DEFAULTS = {f.name: f.default for f in fields(Task) if f.default is not MISSING}
_STATES = {s.value: s for s in State}  # a lookup, not State(value)
