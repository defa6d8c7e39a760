"""Pydantic models: the task spec producers send (contract v1), tasks and events as stored.

Input models forbid unknown fields, so a typo in a producer's message is an error with the field
named, never a silently ignored setting.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import NAMESPACE_URL, UUID, uuid4, uuid5

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared.errors import InvalidSpec
from shared.execlimits import check_exec_size
from shared.fsm import State
from shared.redact import printable
from shared.task import Task as Task  # re-exported: where tasks were always imported from

SCHEMA_VERSION: Literal[1] = 1

# module.path:function or module.path.function
_HANDLER = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*([:.][A-Za-z_]\w*)$")


# Validation context of a spec submitted now (TaskSpec.parse, a workflow's tasks): bounds
# added after specs were first stored apply to new specs only, never to reading a stored one.
NEW = {"new": True}
LABELS_MAX = 64  # labels a spec's selector or affinity may hold
LABEL_MAX = 253  # characters of a label's key or value there


class _Input(BaseModel):
    # NaN and Infinity are no JSON numbers: refused here, not sent as the null pydantic
    # writes for them (a handler would run with None where its caller passed NaN)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def json_number(value: Any, kind: str = "number") -> Any:
    """A field validator (mode "before") for a number from outside: pydantic's lax mode read
    true as 1 and "2" as 2, so a producer's `"schedule_timeout_s": true` was a task failed for
    good a second after it was ready. JSON's own types only."""
    if isinstance(value, bool | str):
        raise ValueError(f"must be a JSON {kind}, not {printable(json.dumps(value)[:40])}")
    return value


def json_integer(value: Any) -> Any:
    """`json_number` for an integer field (an integral 2.0 still reads as 2)."""
    return json_number(value, "integer")


MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
INT32_MAX = 2**31 - 1  # Postgres's integer


class CommandJob(_Input):
    kind: Literal["command"] = "command"
    argv: list[str] = Field(min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    image: str | None = None  # the container image, for the Kubernetes backend

    @model_validator(mode="after")
    def _startable(self, info: ValidationInfo) -> CommandJob:
        # over what execve() takes, every attempt would fail to start (E2BIG), retried as a
        # launch failure without a reason that names it: refused on input (NEW), saying why
        if (info.context or {}).get("new"):
            check_exec_size(self.argv, self.env)
        return self


class HandlerJob(_Input):
    kind: Literal["handler"] = "handler"
    handler: str = Field(max_length=300, description="a dotted Python callable: pkg.mod:func")
    args: JsonValue = None

    @field_validator("handler")
    @classmethod
    def _dotted(cls, value: str) -> str:
        if not _HANDLER.match(value):
            raise ValueError(f"handler must look like 'package.module:function', got {value!r}")
        return value


Job = Annotated[CommandJob | HandlerJob, Field(discriminator="kind")]


class Resources(_Input):
    # No declared cpu means best effort: bounded by the node's slots only, as in Kubernetes.
    cpu: float = Field(default=0.0, ge=0, le=1024)
    memory_mb: int = Field(default=0, ge=0, le=16 * 1024 * 1024)
    gpu: int = Field(default=0, ge=0, le=64)
    _number = field_validator("cpu", mode="before")(json_number)
    _integers = field_validator("memory_mb", "gpu", mode="before")(json_integer)


class TaskSpec(_Input):
    """What a producer asks for. Contract v1."""

    schema_version: Literal[1] = SCHEMA_VERSION
    name: str = Field(min_length=1, max_length=200)
    job: Job
    priority: int = Field(
        default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY, description="higher runs first"
    )
    max_retries: int = Field(default=0, ge=0, le=100)
    # attempts that never started (unschedulable, image pull back-off: a backend's launch
    # failure) go back to Ready without spending a retry, at most this many times
    max_launch_failures: int = Field(default=3, ge=0, le=100)
    backoff_base_s: float = Field(default=1.0, gt=0, le=3600)
    backoff_cap_s: float = Field(default=300.0, gt=0, le=86_400)
    timeout_s: float | None = Field(default=None, gt=0, le=7 * 86_400)
    schedule_timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=7 * 86_400,
        description="the longest the task may wait to start: counted from when it last entered "
        "Ready from a waiting state (released, resumed, or after a retry's backoff) until its "
        "attempt starts (Scheduling -> Running); an attempt that comes back to Ready without "
        "having run does not restart the clock (one that failed to launch gets back the time "
        "it had left). Past it the task ends Failed, final (no retry)",
    )
    # also the attempt's lease: the node's watchdog freezes an attempt not renewed this long
    heartbeat_timeout_s: float = Field(default=30.0, ge=1.0, le=86_400)
    _integers = field_validator("priority", "max_retries", "max_launch_failures", mode="before")(
        json_integer
    )
    _numbers = field_validator(
        "backoff_base_s",
        "backoff_cap_s",
        "timeout_s",
        "schedule_timeout_s",
        "heartbeat_timeout_s",
        mode="before",
    )(json_number)
    resources: Resources = Field(default_factory=Resources)
    # required node labels; bounded like affinity for new specs (`_selector_bounded`)
    selector: dict[str, str] = Field(default_factory=dict)
    # read by placement for every node, on every pass that tries the task: bounded
    affinity: dict[
        Annotated[str, Field(min_length=1, max_length=LABEL_MAX)],
        Annotated[str, Field(max_length=LABEL_MAX)],
    ] = Field(
        default_factory=dict,
        max_length=LABELS_MAX,
        description="node labels the task prefers, not requires: of the nodes that fit, one "
        "carrying more of them scores higher (placement's affinity term); at most 64",
    )
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)

    @field_validator("selector")
    @classmethod
    def _selector_bounded(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        """A new spec's selector holds at most 64 labels, keys of 1-253 characters and values
        of at most 253, as affinity does: placement reads it for every node on every pass that
        tries the task. Checked on input only (`NEW`): a spec stored before the bound must
        still read back, or the task it belongs to could never be placed nor ended."""
        if not (info.context or {}).get("new"):
            return value
        if len(value) > LABELS_MAX or any(
            not 0 < len(k) <= LABEL_MAX or len(v) > LABEL_MAX for k, v in value.items()
        ):
            raise ValueError(
                f"at most {LABELS_MAX} labels, keys of 1-{LABEL_MAX} characters and values of "
                f"at most {LABEL_MAX}"
            )
        return value

    @classmethod
    def parse(cls, data: object) -> TaskSpec:
        """Validate a dict or a JSON string as a new spec; raise InvalidSpec naming each bad
        field."""
        try:
            if isinstance(data, str | bytes):
                return cls.model_validate_json(data, context=NEW)
            return cls.model_validate(data, context=NEW)
        except ValidationError as exc:
            raise InvalidSpec(describe(exc)) from None


def task_id_for(spec: TaskSpec, message_id: str | None = None) -> UUID:
    """The id a submitted task gets, the same however often the submission is delivered.

    With an idempotency key: derived from the key, so every submission with that key names the
    same task. Else the message id when it is a UUID (the SDK's), or a UUID derived from any
    other message id. Without either, a redelivery (which only follows a scheduler crash) could
    create a second task: producers that cannot set a message id should use a key.
    """
    if spec.idempotency_key is not None:
        return uuid5(NAMESPACE_URL, f"sked:idempotency-key:{spec.idempotency_key}")
    return _id_of_message(message_id, "message-id")


def task_id_for_workflow(message_id: str | None) -> UUID:
    """A workflow's id: its submission's message id (the SDK's), stable across deliveries."""
    return _id_of_message(message_id, "workflow-message")


def _id_of_message(message_id: str | None, kind: str) -> UUID:
    """The message id itself when it is a UUID, else one derived from it (in `kind`'s own
    namespace); a fresh one when there is none."""
    if not message_id:
        return uuid4()
    try:
        return UUID(message_id)
    except ValueError:
        return uuid5(NAMESPACE_URL, f"sked:{kind}:{message_id}")


def describe(exc: ValidationError) -> str:
    """One line per problem: `job.argv: List should have at least 1 item`."""
    parts = []
    for err in exc.errors(include_url=False, include_input=False):
        # a location may be a producer's own key: shown inert, a reason is one line
        where = ".".join(printable(str(p)) for p in err["loc"]) or "(message)"
        parts.append(f"{where}: {printable(err['msg'])}")
    return "invalid task spec: " + "; ".join(parts)


class Event(BaseModel):
    """One recorded transition (and the outbox row that announces it)."""

    model_config = ConfigDict(frozen=True)

    id: int
    task_id: UUID
    from_status: State | None
    to_status: State
    version: int
    attempt: int
    reason: str
    at: datetime


class EventMessage(BaseModel):
    """The body the relay publishes to `sked.events`: consecutive events of one target state."""

    schema_version: Literal[1] = SCHEMA_VERSION
    events: list[Event]


class Dispatch(BaseModel):
    """Scheduler -> executor: run this attempt. Routing key: the node id."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    task_id: UUID
    attempt: int = Field(ge=1, le=INT32_MAX)
    # the task's version in Scheduling: the executor's start CAS is fenced by it
    version: int = Field(ge=1, le=INT32_MAX)
    retry_count: int = Field(ge=0, le=INT32_MAX)
    max_retries: int = Field(ge=0, le=INT32_MAX)
    node: str = Field(max_length=63)

    @classmethod
    def of(cls, task: Task, node: str | None = None) -> Dispatch:
        """The dispatch of `task`'s current attempt to `node` (default: the one it holds)."""
        target = node or task.node
        if target is None:
            raise ValueError(f"task {task.id} is not placed on a node")
        counters = {
            k: getattr(task, k) for k in ("attempt", "version", "retry_count", "max_retries")
        }
        return cls(task_id=task.id, node=target, **counters)

    @property
    def id(self) -> UUID:
        return self.task_id

    @property
    def status(self) -> State:
        return State.SCHEDULING

    # No move from Scheduling counts launch failures: the executor's CAS needs neither.
    @property
    def launch_failures(self) -> int:
        return 0

    @property
    def max_launch_failures(self) -> int:
        return 0
