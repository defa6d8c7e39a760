"""Deciding what a submitted message is: a task to accept, or a reason to dead-letter it (pure).

`judge` never raises: whatever a producer sends — not JSON, too deep, NaN, a NUL, a 5,000-digit
number, a spec with unknown fields — comes back as a Rejected with the reason, so one message
can never stop intake.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from shared.errors import InvalidSpec, one_line
from shared.jsonvalue import Unsafe, parse
from shared.models import TaskSpec, task_id_for
from shared.policy import JobPolicy

JSON_TYPES = {None, "", "application/json"}
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


@dataclass(frozen=True)
class Accepted:
    task_id: UUID
    spec: TaskSpec


@dataclass(frozen=True)
class Rejected:
    reason: str


def judge(
    body: bytes,
    content_type: str | None,
    message_id: str | None,
    max_bytes: int,
    policy: JobPolicy = JobPolicy(),  # noqa: B008 - immutable
) -> Accepted | Rejected:
    try:
        return _judge(body, content_type, message_id, max_bytes, policy)
    except Exception as exc:  # a last line: nothing a producer sends may stop intake
        return Rejected(f"unreadable message: {one_line(exc)}")


def _judge(
    body: bytes, content_type: str | None, message_id: str | None, max_bytes: int, policy: JobPolicy
) -> Accepted | Rejected:
    if len(body) > max_bytes:
        return Rejected(f"message of {len(body)} bytes exceeds the limit of {max_bytes} bytes")
    if content_type not in JSON_TYPES:
        return Rejected(f"content type {content_type!r} is not application/json")
    data = read_json(body)
    if isinstance(data, Rejected):
        return data
    if not isinstance(data, dict):
        return Rejected(f"a task spec must be a JSON object, got {type(data).__name__}")
    try:
        spec = TaskSpec.parse(data)
    except InvalidSpec as exc:
        return Rejected(str(exc))
    refused = policy.refuses(spec.job)
    if refused:
        return Rejected(refused)
    return Accepted(task_id_for(spec, message_id), spec)


def read_json(body: bytes) -> Any:
    """The message's JSON, or a Rejected saying why sked will not take it."""
    try:
        return parse(body)
    except Unsafe as exc:
        text = str(exc)
        return Rejected(text if text.startswith("malformed JSON") else f"unsafe JSON: {text}")


def header_text(
    headers: Mapping[str, Any] | None, name: str, pattern: re.Pattern[str]
) -> str | None:
    """A header's value if it is text matching `pattern`; anything else (another type, bytes
    that are not UTF-8, a malformed value) counts as absent rather than failing the message."""
    value = (headers or {}).get(name)
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str) and len(value) <= 256 and pattern.match(value):
        return value
    return None


def traceparent(headers: Mapping[str, Any] | None) -> str | None:
    """A W3C traceparent from the headers, if there is a well-formed one."""
    return header_text(headers, "traceparent", _TRACEPARENT)


def same_spec(stored_json: str, spec: TaskSpec) -> bool:
    """Whether a stored spec is the one submitted again (its priority may have been changed by
    an operator since: that is still the same task)."""
    stored = json.loads(stored_json)
    fresh = spec.model_dump(mode="json")
    stored.pop("priority", None)
    fresh.pop("priority", None)
    return bool(stored == fresh)
