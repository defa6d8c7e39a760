"""What the operator API takes and returns, as pydantic models: request bodies are validated
with them, and the OpenAPI document's schemas are generated from them (openapi.py).

The views of stored rows (Task, Node, Token, AuditEntry) are derived from the dataclasses
themselves, field by field, so that a column added there shows up here without a second list;
a unit test holds every view to the JSON its row really gives.
"""

from __future__ import annotations

import dataclasses
import typing
from datetime import datetime
from typing import Annotated, Any
from uuid import UUID

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, create_model

from shared.auth import Role
from shared.dag import WorkflowSpec
from shared.dead_letters import DeadLetter
from shared.models import Event, Task, TaskSpec
from shared.store import NodeRow
from shared.store.tokens import AuditRow, TokenRow

MAX_TEXT = 1000  # reasons and names given by a caller


def view_of(cls: type[Any], name: str, doc: str, **renamed: tuple[str, Any]) -> type[BaseModel]:
    """A pydantic model with the fields of dataclass `cls` (all required: a row's JSON always
    has every key); `renamed`: field -> (JSON key, type) where the JSON differs."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key, kind = renamed.get(f.name, (f.name, hints[f.name]))
        fields[key] = (kind, ...)
    model: type[BaseModel] = create_model(name, __doc__=doc, **fields)
    return model


TaskView = view_of(
    Task,
    "Task",
    "A task as stored: its spec, where it is in its lifecycle, its attempt and outcome.",
    spec_json=("spec", TaskSpec),
)
NodeView = view_of(
    NodeRow,
    "Node",
    "A registered node: capacity, usage (attempts holding it), liveness and cordon.",
)
TokenView = view_of(TokenRow, "Token", "An API token (its secret is never shown again).")
AuditView = view_of(AuditRow, "AuditEntry", "One change made through the API, by token.")
DeadLetterView = view_of(
    DeadLetter, "DeadLetter", "A refused submission: why, its routing key, and its start."
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _printable(text: str | None) -> str | None:
    """Who a change was made for is one line of plain text: a line break or a terminal's
    escape in it would let a caller forge a line of the task's history as shown."""
    if text is not None and not text.isprintable():
        raise ValueError("must be printable text: no line breaks or control characters")
    return text


OnBehalf = Annotated[
    str | None,
    Field(
        default=None,
        max_length=200,
        description="on whose behalf; recorded after the token's name, never instead of it",
    ),
    AfterValidator(_printable),
]


class PauseBody(_Body):
    reason: str = Field(min_length=1, max_length=MAX_TEXT)
    by: OnBehalf = None


class CancelBody(_Body):
    reason: str = Field(default="", max_length=MAX_TEXT)
    by: OnBehalf = None


class ResumeBody(_Body):
    by: OnBehalf = None


class PriorityBody(_Body):
    priority: StrictInt  # not true, nor "7"


class CordonBody(_Body):
    reason: str = Field(default="", max_length=MAX_TEXT)


class TokenBody(_Body):
    role: Role
    name: str | None = Field(default=None, max_length=63)


class Accepted(BaseModel):
    """A submission RabbitMQ confirmed: admission (intake) follows."""

    id: UUID


class Error(BaseModel):
    error: str


class Health(BaseModel):
    ok: bool


class Log(BaseModel):
    id: UUID
    status: str
    log: str | None = Field(description="live from the executor while running; else the tail")


class Drain(BaseModel):
    node: NodeView  # type: ignore[valid-type]
    drained: bool
    holding: list[UUID] = Field(description="tasks whose attempts still hold the node")


class WorkflowEdge(BaseModel):
    upstream: UUID
    task: UUID
    condition: str


class WorkflowSummaryView(BaseModel):
    """A workflow as a listing shows it."""

    model_config = ConfigDict(title="WorkflowSummary")
    id: UUID
    name: str
    created_at: datetime
    status: str = Field(description="running, paused, succeeded, failed or canceled")
    counts: dict[str, int] = Field(description="its tasks by state")
    open: int = Field(description="its tasks not ended yet")


class Workflow(BaseModel):
    id: UUID
    name: str
    status: str = Field(description="running, paused, succeeded, failed or canceled")
    counts: dict[str, int]
    tasks: list[TaskView]  # type: ignore[valid-type]
    edges: list[WorkflowEdge]


class TokenCreated(BaseModel):
    token: TokenView  # type: ignore[valid-type]
    secret: str = Field(description="shown once: only its SHA-256 is kept")


# every schema the document names, request and response alike
COMPONENTS: tuple[type[BaseModel], ...] = (
    TaskSpec,
    WorkflowSpec,
    TaskView,
    Event,
    NodeView,
    TokenView,
    AuditView,
    DeadLetterView,
    PauseBody,
    CancelBody,
    ResumeBody,
    PriorityBody,
    CordonBody,
    TokenBody,
    Accepted,
    Error,
    Health,
    Log,
    Drain,
    Workflow,
    WorkflowSummaryView,
    TokenCreated,
)
