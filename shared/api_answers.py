"""What the operator API answers, read back (pure): rows rebuilt from their JSON, and any
answer of another shape a SkedError naming the path, never a bare KeyError or TypeError; ids
checked before they go into a path; a wait's deadline from its timeout."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

from shared.errors import SkedError
from shared.fsm import State
from shared.models import Task

if TYPE_CHECKING:
    from shared.cordon import Drain
    from shared.store import NodeRow

T = TypeVar("T")


def from_json(cls: type[Any], data: Mapping[str, Any], **given: Any) -> Any:
    """A row dataclass (Task, NodeRow) back from its `as_json()`: datetimes, UUIDs and states
    parsed by the field's type; `given` fields are taken as they are."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in values or f.name not in data:
            continue
        value, hint = data[f.name], hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = typing.get_args(hint) if union else (hint,)
        if value is not None:
            if datetime in kinds:
                value = datetime.fromisoformat(value)
            elif UUID in kinds:
                value = UUID(value)
            elif State in kinds:
                value = State(value)
            elif not any(_fits(value, kind) for kind in kinds):
                # caught here, not where the CLI prints it (a TypeError from a format spec)
                raise TypeError(f"{f.name} is {type(value).__name__}, not {hint}")
        values[f.name] = value
    return cls(**values)


def _fits(value: Any, kind: Any) -> bool:
    """Whether a JSON value is of a field's type (or one of a union's); a bool is no number."""
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin = typing.get_origin(kind) or kind
    return origin is Any or not isinstance(origin, type) or isinstance(value, origin)


def task_of(data: Mapping[str, Any]) -> Task:
    task: Task = from_json(Task, data, spec_json=json.dumps(data["spec"]))
    return task


def node_of(data: Mapping[str, Any]) -> NodeRow:
    from shared.store import NodeRow

    node: NodeRow = from_json(NodeRow, data)
    return node


def drain_of(data: Any) -> Drain:
    from shared.cordon import Drain

    return Drain(node_of(data["node"]), uuids(data["holding"]))


def uuids(values: Any) -> list[UUID]:
    return [UUID(v) for v in values]


def read_answer(path: str, build: Callable[[], T]) -> T:
    """What an answer was read into; an answer of another shape is a SkedError naming the
    path, never a bare KeyError or TypeError."""
    try:
        return build()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise SkedError(f"the API answered {path} with an unexpected body: {exc!r}"[:500]) from None
