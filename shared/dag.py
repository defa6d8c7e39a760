"""Workflows (DAGs): the file format, validation, priority inheritance, edge conditions (pure).

A workflow is tasks plus edges (`needs`), accepted or rejected whole: names are unique, every
edge names a task of the workflow, every `uses` names a declared resource, and there is no
cycle — the standard library's graphlib finds one, and the error names it (`a -> b -> a`).
This module decides; the scheduler (a later step) stores and drives.
"""

from __future__ import annotations

import graphlib
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

from shared.errors import InvalidSpec
from shared.fsm import State
from shared.models import NEW, TaskSpec, describe, json_integer, json_number

MAX_DEPENDENCY_WAIT_S = 366 * 86_400.0  # a dependency's timeout: a year at most
MAX_CAPACITY = 1_000_000  # a named resource's holders at once
# what a workflow task's options may not set: the workflow task's own name and job are the
# task's (a downstream's inputs are keyed by the upstream's name)
NOT_OPTIONS = frozenset({"name", "job"})


class Condition(StrEnum):
    ON_SUCCESS = "on_success"
    ON_FAILURE = "on_failure"
    ALWAYS = "always"


class Edge(BaseModel):
    """One dependency: this task needs `task`, under `condition`, waiting at most
    `timeout_s`, then `on_timeout`: skip it, go on with `default` as its input, or fail."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    task: str
    condition: Condition = Condition.ON_SUCCESS
    # bounded, as every duration a task spec takes: Postgres adds it to a timestamp
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_DEPENDENCY_WAIT_S)
    _numbers = field_validator("timeout_s", mode="before")(json_number)
    on_timeout: Literal["skip", "default", "fail"] = "fail"
    default: JsonValue = None


class WorkflowTask(BaseModel):
    """A task as written in a workflow file: `command` or `handler`, plus `needs` and `uses`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=200)
    command: list[str] | None = None
    image: str | None = None  # with command: its container image (the Kubernetes backend)
    handler: str | None = None
    args: JsonValue = None
    needs: list[Edge] = Field(default_factory=list)
    uses: list[str] = Field(default_factory=list)
    # everything else a task spec takes (priority, max_retries, timeout_s, resources, ...)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = {"name", "command", "image", "handler", "args", "needs", "uses", "options"}
        out = {k: v for k, v in data.items() if k in known}
        given = data.get("options") or {}
        needs = data.get("needs") or []  # YAML's empty `needs:` is null
        # raised as ValueError: pydantic names the field for it (a TypeError would escape)
        if not isinstance(given, dict):
            raise ValueError(f"options must be a mapping, not {type(given).__name__}")
        if not isinstance(needs, list):
            raise ValueError(f"needs must be a list of task names, not {type(needs).__name__}")
        # the file form puts options at the task's top level; the dumped form, under "options"
        out["options"] = {**given, **{k: v for k, v in data.items() if k not in known}}
        if taken := sorted(NOT_OPTIONS & out["options"].keys()):
            raise ValueError(f"{', '.join(taken)} cannot be set as an option")
        # `needs: [extract]` is short for `needs: [{task: extract}]`
        out["needs"] = [{"task": n} if isinstance(n, str) else n for n in needs]
        return out

    def spec(self) -> TaskSpec:
        """The task spec this workflow task runs with (InvalidSpec names the task)."""
        if (self.command is None) == (self.handler is None):
            raise InvalidSpec(f"task {self.name!r}: give exactly one of command or handler")
        if self.image is not None and self.command is None:
            raise InvalidSpec(f"task {self.name!r}: image goes with command")
        if self.needs and isinstance(self.args, dict) and "inputs" in self.args:
            # the worker would pass `inputs` twice to a handler that takes it, and fail the
            # same way on every retry: refused here, once, with the reason
            raise InvalidSpec(
                f"task {self.name!r}: args cannot name 'inputs': a task with upstreams gets "
                "their outputs by that name"
            )
        job: dict[str, Any] = (
            {"kind": "command", "argv": self.command, "image": self.image}
            if self.command is not None
            else {"kind": "handler", "handler": self.handler, "args": self.args}
        )
        try:
            spec = {"name": self.name, "job": job, **self.options}
            return TaskSpec.model_validate(spec, context=NEW)
        except ValidationError as exc:
            raise InvalidSpec(f"task {self.name!r}: {describe(exc)}") from None


class WorkflowSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=200)
    resources: dict[str, Annotated[int, Field(le=MAX_CAPACITY)]] = Field(default_factory=dict)

    @field_validator("resources", mode="before")
    @classmethod
    def _capacities(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for capacity in value.values():
                json_integer(capacity)
        return value

    tasks: list[WorkflowTask] = Field(min_length=1, max_length=100_000)

    @classmethod
    def parse(cls, data: object) -> WorkflowSpec:
        """Validate shape and graph; raise InvalidSpec naming what is wrong."""
        try:
            spec = cls.model_validate(data)
        except ValidationError as exc:
            raise InvalidSpec(describe(exc).replace("task spec", "workflow")) from None
        spec.check()
        return spec

    def check(self) -> list[str]:
        """The whole workflow's consistency; returns the names in a topological order."""
        seen: set[str] = set()
        for task in self.tasks:
            if task.name in seen:
                raise InvalidSpec(f"workflow {self.name!r}: two tasks are named {task.name!r}")
            seen.add(task.name)
        for name, capacity in self.resources.items():
            if capacity < 1:
                raise InvalidSpec(f"resource {name!r}: capacity must be at least 1")
        keys: dict[str, str] = {}
        for task in self.tasks:
            upstreams: set[str] = set()
            for edge in task.needs:
                if edge.task not in seen:
                    raise InvalidSpec(f"task {task.name!r} needs unknown task {edge.task!r}")
                if edge.task in upstreams:  # one edge a pair: two conditions cannot both hold
                    raise InvalidSpec(f"task {task.name!r} needs {edge.task!r} twice")
                upstreams.add(edge.task)
            for resource in task.uses:
                if resource not in self.resources:
                    raise InvalidSpec(f"task {task.name!r} uses undeclared resource {resource!r}")
            key = task.spec().idempotency_key
            if key is not None:
                if key in keys:
                    raise InvalidSpec(
                        f"tasks {keys[key]!r} and {task.name!r} share the idempotency key {key!r}"
                    )
                keys[key] = task.name
        return topological_order({t.name: [e.task for e in t.needs] for t in self.tasks})


def topological_order(needs: Mapping[str, Iterable[str]]) -> list[str]:
    """Upstream before downstream; a cycle raises InvalidSpec naming it: `a -> b -> c -> a`."""
    sorter = graphlib.TopologicalSorter({k: list(v) for k, v in needs.items()})
    try:
        return list(sorter.static_order())
    except graphlib.CycleError as exc:
        # graphlib gives the cycle as [n1, n2, ..., n1], each an upstream of the next: the
        # direction work flows
        cycle = list(exc.args[1])
        raise InvalidSpec(f"the workflow has a cycle: {' -> '.join(cycle)}") from None


def effective_priorities(
    own: Mapping[str, int], needs: Mapping[str, Iterable[str]]
) -> dict[str, int]:
    """Priority inheritance: a task runs at the highest priority of itself and of every task
    that (transitively) depends on it, so a low upstream never holds back a high downstream."""
    order = topological_order(needs)
    effective = dict(own)
    for name in reversed(order):  # downstream first: each passes its priority upstream
        for upstream in needs.get(name, ()):
            effective[upstream] = max(effective[upstream], effective[name])
    return effective


class Verdict(StrEnum):
    WAIT = "wait"
    READY = "ready"
    SKIP = "skip"
    FAIL = "fail"  # a dependency timed out with policy "fail"


FINISHED = {State.SUCCESS, State.FAILED, State.TIMED_OUT, State.CANCELED, State.SKIPPED}


def edge_holds(condition: Condition, upstream: State) -> bool | None:
    """True: satisfied; False: can never be; None: not decided yet (upstream not finished)."""
    if upstream not in FINISHED:
        return None
    if condition is Condition.ALWAYS:
        return True
    if condition is Condition.ON_SUCCESS:
        return upstream is State.SUCCESS
    return upstream in (State.FAILED, State.TIMED_OUT)


def decide(
    edges: Iterable[tuple[Condition, State] | tuple[Condition, State, str | None]],
) -> tuple[Verdict, str]:
    """Given each edge's condition, its upstream's (terminal or not) state, and — for an edge
    whose wait timed out — its policy: run, skip (with the reason; a skip then propagates
    through the edges that need success), fail, or wait."""
    waiting = False
    notes = []
    for edge in edges:
        condition, upstream = edge[0], edge[1]
        timed_out = edge[2] if len(edge) > 2 else None
        if timed_out == "fail":
            return Verdict.FAIL, "a dependency timed out (policy fail)"
        if timed_out in ("skip", "default"):
            notes.append(f"a dependency timed out (policy {timed_out})")
            continue  # go on without it (or with its default)
        holds = edge_holds(condition, upstream)
        if holds is False:
            return (
                Verdict.SKIP,
                f"condition {condition.value} cannot hold: upstream {upstream.label}",
            )
        if holds is None:
            waiting = True
    if waiting:
        return Verdict.WAIT, "waiting for upstream"
    return Verdict.READY, "; ".join(["dependencies met", *notes])


def output_of(kind: str, result: Any) -> Any:
    """What a finished task hands downstream: a handler's return value; a command's declared
    output (the JSON it wrote to the file named by $SKED_OUTPUT), or None if it declared none."""
    if kind == "command":
        return result.get("output") if isinstance(result, dict) else None
    return result


# The JSON of the outputs a task receives from its upstreams, at most. Each result is capped
# (outcome.MAX_RESULT_BYTES), but a fan-in adds them up: unbounded, a wide one would make a row
# Postgres refuses (a jsonb value holds at most 255 MB) and fail the release of every task in
# the batch, again on each pass; and each claim would carry it to its executor.
MAX_INPUTS_BYTES = 8 * 1024 * 1024


def inputs_too_large(inputs: Mapping[str, Any]) -> str | None:
    """Why a task cannot take these inputs (their JSON over MAX_INPUTS_BYTES); None if it can."""
    from pydantic_core import to_json

    return too_large(len(to_json(inputs)))


def too_large(size: int) -> str | None:
    """Why a task cannot take inputs of `size` bytes of JSON; None if it can."""
    if size <= MAX_INPUTS_BYTES:
        return None
    return (
        f"its upstreams' outputs are {size} bytes of JSON, over the limit of {MAX_INPUTS_BYTES} "
        "(pass large data by reference)"
    )


def inputs_of(edges: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A released task's inputs, from its edges (each: the upstream's name, kind, state and
    result, the edge's timeout policy and default): {upstream name: output} for every upstream
    that succeeded; the edge's default where its wait timed out under policy `default`. An
    upstream that was skipped, failed, or timed out under `skip` is absent."""
    inputs: dict[str, Any] = {}
    for edge in edges:
        name = edge["upstream_name"]
        if edge["status"] == State.SUCCESS.value:
            inputs[name] = output_of(edge["upstream_kind"], edge["upstream_result"])
        elif edge["policy"] == "default":
            inputs[name] = edge["default_value"]
    return inputs
