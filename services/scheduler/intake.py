"""Deciding what a submitted message is: a task to accept, or a reason to dead-letter it (pure)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from uuid import UUID

from shared.errors import InvalidSpec
from shared.models import TaskSpec, task_id_for

JSON_TYPES = {None, "", "application/json"}


@dataclass(frozen=True)
class Accepted:
    task_id: UUID
    spec: TaskSpec


@dataclass(frozen=True)
class Rejected:
    reason: str


def judge(
    body: bytes, content_type: str | None, message_id: str | None, max_bytes: int
) -> Accepted | Rejected:
    if len(body) > max_bytes:
        return Rejected(f"message of {len(body)} bytes exceeds the limit of {max_bytes} bytes")
    if content_type not in JSON_TYPES:
        return Rejected(f"content type {content_type!r} is not application/json")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return Rejected(f"malformed JSON: {exc}")
    if not isinstance(data, dict):
        return Rejected(f"a task spec must be a JSON object, got {type(data).__name__}")
    try:
        spec = TaskSpec.parse(data)
    except InvalidSpec as exc:
        return Rejected(str(exc))
    return Accepted(task_id_for(spec, message_id), spec)
