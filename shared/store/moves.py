"""A batch of moves as the CAS statements take them (`transition`, `sked_admit`): one array a
column, and each move's patch as JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic_core import PydanticSerializationError, to_json

from shared.fsm import Move


def _json_default(value: Any) -> Any:
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise TypeError(f"cannot store {type(value).__name__} in a transition patch")


# json.dumps with these options builds this encoder on every call: one, built once.
# allow_nan=False: a NaN would reach Postgres as a token jsonb refuses.
_PATCH = json.JSONEncoder(default=_json_default, allow_nan=False)


def _patch_json(patch: Mapping[str, Any]) -> str:
    """A move's patch as JSON. pydantic's encoder writes it at a fifth of the cost (every
    move of every statement has one); what it writes as NaN or Infinity, or any value that
    is not plain JSON, goes through the strict encoder above, which refuses it as before."""
    try:
        text = to_json(patch).decode()
    except PydanticSerializationError:
        return _PATCH.encode(dict(patch))
    if "NaN" in text or "Infinity" in text:  # a non-finite float, or only a string with it
        return _PATCH.encode(dict(patch))
    return text


def move_args(moves: Sequence[Move]) -> tuple[list[Any], ...]:
    ids = [m.task_id for m in moves]
    if len(set(ids)) != len(ids):
        raise ValueError("a batch may move each task only once")
    return (
        ids,
        [m.version for m in moves],
        [m.source.value for m in moves],
        [m.target.value for m in moves],
        [m.reason for m in moves],
        [_patch_json(m.patch) for m in moves],
    )
