"""The dispatch message (pure): a scheduler sends a node the attempts one placement pass put
there in one message, each with its trace headers; an executor reads each entry alone.

A message per attempt cost each side a message's worth of work per task — aio-pika's objects,
frames, a confirm and an acknowledgement, RabbitMQ's own bookkeeping — the largest per-task
cost left in the scheduler's and the executor's messaging (docs/performance.md). Body:

    {"schema_version": 1, "dispatches": [{"dispatch": {<Dispatch>}, "headers": {...}}, ...]}

A body that is one Dispatch (what sked sent before) is read as a batch of one, its headers
the message's. Every input is hostile until checked: a body past MAX_BODY_BYTES is not parsed,
an entry that cannot be read is refused alone (a message of that entry alone is what its dead
letter keeps, written only then), and the rest of the message is used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from pydantic import ValidationError
from pydantic_core import to_json

from shared.errors import one_line
from shared.jsonvalue import Unsafe, parse
from shared.models import SCHEMA_VERSION, Dispatch, Task

MAX_DISPATCHES = 1000  # entries one message may carry; a pass places dispatch_batch at most
MAX_HEADERS = 16  # trace headers are a handful: traceparent, tracestate, baggage
MAX_HEADER_CHARS = 1024
# entries a placement notification carries at most (sql: placed_payload); a node given more
# by one admission is told by its dispatch message alone (sked_admit: `HAVING count(*) <= 100`)
MAX_PLACED = 100
# A full message of MAX_DISPATCHES entries with their trace headers is ~0.5 MB.
MAX_BODY_BYTES = 4 << 20
# An entry's header with its task's score in the ready line (shared.queues.score: lower goes
# first), so that a node's backlog starts its held dispatches in the line's order. A header,
# not a field of the entry: an executor that predates it takes it for a trace header.
LINE_HEADER = "x-sked-line"


def line_of(headers: Mapping[str, Any]) -> float | None:
    """The score an entry's LINE_HEADER gives, if it is a finite number; else None."""
    text = headers.get(LINE_HEADER)
    if not isinstance(text, str):
        return None
    try:
        score = float(text)
    except ValueError:
        return None
    return score if math.isfinite(score) else None


@dataclass(frozen=True)
class Entry:
    """One entry of a dispatch message: the dispatch, or why it cannot be used."""

    dispatch: Dispatch | None
    problem: str | None  # set when dispatch is None
    headers: Mapping[str, Any]
    source: Any  # the entry as read (bytes: the whole body, for a single-dispatch message)

    @property
    def raw(self) -> bytes:
        """What a dead letter of this entry alone carries: a message of it alone (JSON is
        written only here, for the rare refusal, not for every entry read)."""
        if isinstance(self.source, bytes):
            return self.source
        wrapped = {"schema_version": SCHEMA_VERSION, "dispatches": [self.source]}
        return json.dumps(wrapped, separators=(",", ":")).encode()


def pack(dispatches: Sequence[tuple[Dispatch | Mapping[str, Any], Mapping[str, Any]]]) -> bytes:
    """One message's body: these dispatches (all to one node), each with its headers. A
    dispatch may come as its JSON already (`entry_of`). Written by pydantic's encoder: the
    bytes json.dumps writes with these separators, at a third of its cost (~0.8 µs an entry
    against ~2.4; the scheduler packs every attempt it places)."""
    return to_json(
        {
            "schema_version": SCHEMA_VERSION,
            "dispatches": [
                {
                    "dispatch": d.model_dump(mode="json") if isinstance(d, Dispatch) else d,
                    "headers": dict(h),
                }
                for d, h in dispatches
            ],
        }
    )


def entry_of(task: Task) -> dict[str, Any]:
    """`Dispatch.of(task).model_dump(mode="json")`, without building the model: the values
    are a stored row's, of the columns' types, and the scheduler writes one for every task it
    places (tests/unit/test_dispatches holds the two equal)."""
    if task.node is None:
        raise ValueError(f"task {task.id} is not placed on a node")
    return {
        "schema_version": SCHEMA_VERSION,
        "task_id": str(task.id),
        "attempt": task.attempt,
        "version": task.version,
        "retry_count": task.retry_count,
        "max_retries": task.max_retries,
        "node": task.node,
    }


def unpack(body: bytes, headers: Mapping[str, Any] | None = None) -> list[Entry]:
    """The entries of a dispatch message, each checked alone. A body that is not a dispatch
    message at all is one entry with the problem, keeping the whole body."""
    if len(body) > MAX_BODY_BYTES:
        return [_refused(f"unreadable dispatch: {len(body)} bytes, over {MAX_BODY_BYTES}", body)]
    try:
        data = parse(body)
    except Unsafe as exc:
        return [_refused(f"unreadable dispatch: {exc}", body)]
    if not (isinstance(data, dict) and "dispatches" in data):
        return [_entry(data, body, headers or {})]  # one dispatch, as sent before batches
    entries = data.get("dispatches")
    if data.get("schema_version") != SCHEMA_VERSION or set(data) != {
        "schema_version",
        "dispatches",
    }:
        return [_refused("unreadable dispatch message: not schema version 1", body)]
    if not isinstance(entries, list) or not 0 < len(entries) <= MAX_DISPATCHES:
        return [
            _refused(
                f"unreadable dispatch message: 'dispatches' must be a list of 1 to "
                f"{MAX_DISPATCHES} entries",
                body,
            )
        ]
    out = []
    for item in entries:
        if not (isinstance(item, dict) and set(item) <= {"dispatch", "headers"}):
            out.append(_refused("unreadable dispatch: an entry is not {dispatch, headers}", item))
            continue
        out.append(_entry(item.get("dispatch"), item, _headers(item.get("headers"))))
    return out


def placed(payload: str, node: str) -> list[Entry]:
    """The dispatches a placement notification tells `node` of (notify.placed_channel):
    "<task id>:<version>:<attempt>:<retry_count>:<max_retries>" each, space-separated, at
    most MAX_PLACED. Anyone who may connect to the database may NOTIFY: an entry that is not
    such is skipped, and what is read is only ever claimed by the start CAS, which holds it to
    the task's state and version."""
    out = []
    for item in payload.split(maxsplit=MAX_PLACED)[:MAX_PLACED]:
        parts = item.split(":")
        if len(parts) != 5:
            continue
        try:
            version, attempt, retry_count, max_retries = (int(p) for p in parts[1:])
            dispatch = Dispatch(
                task_id=UUID(parts[0]),
                attempt=attempt,
                version=version,
                retry_count=retry_count,
                max_retries=max_retries,
                node=node,
            )
        except ValueError:  # pydantic's ValidationError is one
            continue
        out.append(Entry(dispatch, None, {}, item))
    return out


def _entry(data: Any, source: Any, headers: Mapping[str, Any]) -> Entry:
    try:
        return Entry(Dispatch.model_validate(data), None, headers, source)
    except ValidationError as exc:
        return _refused(f"unreadable dispatch: {one_line(exc)}", source)


def _refused(problem: str, source: Any) -> Entry:
    return Entry(None, problem, {}, source)


def _headers(value: Any) -> dict[str, str]:
    """An entry's trace headers if they are a small map of text to text; anything else is
    dropped (tracing is best effort; the dispatch is still good)."""
    if not isinstance(value, dict) or len(value) > MAX_HEADERS:
        return {}
    ok = all(
        isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= MAX_HEADER_CHARS
        for k, v in value.items()
    )
    return value if ok else {}
