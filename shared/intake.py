"""Deciding what a submitted message is: a task to accept, or a reason to dead-letter it (pure).

`judge` never raises: whatever a producer sends — not JSON, too deep, NaN, a NUL, a 5,000-digit
number, a spec with unknown fields — comes back as a Rejected with the reason, so one message
can never stop intake.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from shared.errors import InvalidSpec, one_line
from shared.jsonvalue import Unsafe, parse, same_json
from shared.models import TaskSpec, task_id_for
from shared.policy import JobPolicy

JSON_TYPES = {None, "", "application/json"}
# W3C trace context: a shape, and a meaning — version ff and an all-zero trace or span id are
# invalid, and OpenTelemetry drops them on extract: kept, such a parent made every span of the
# task start a trace of its own (a parent seemed present, so no root span was started)
_TRACEPARENT = re.compile(
    r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}"
)


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
    data = _read_message(body, content_type, max_bytes)
    if isinstance(data, Rejected):
        return data
    return _verdict(data, message_id, policy)


def _read_message(body: bytes, content_type: str | None, max_bytes: int) -> Any:
    """A message's JSON, or a Rejected: too large, not JSON, or unsafe JSON."""
    if len(body) > max_bytes:
        return Rejected(f"message of {len(body)} bytes exceeds the limit of {max_bytes} bytes")
    if content_type not in JSON_TYPES and not _is_json_type(content_type):
        return Rejected(f"content type {content_type!r} is not application/json")
    return read_json(body)


def _is_json_type(content_type: str | None) -> bool:
    """application/json as a client may spell it: any case, with a UTF-8 charset named (what
    many AMQP clients send); JSON in any other charset is not read as UTF-8."""
    if content_type is None:
        return True
    media, _, params = content_type.partition(";")
    if media.strip().lower() != "application/json":
        return False
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            return False
    return True


def _verdict(data: object, message_id: str | None, policy: JobPolicy) -> Accepted | Rejected:
    """A JSON value as a task spec: accepted under its task id, or the reason it is not."""
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


@dataclass(frozen=True)
class Entry:
    """One submitted task: its verdict, where it came from (a message's body, or a batch
    task's spec as parsed), its id and its trace parent."""

    verdict: Accepted | Rejected
    source: object
    message_id: str
    traceparent: str | None

    @property
    def body(self) -> bytes:
        """What a refusal dead-letters: the message's body, or the batch task's own spec as
        JSON — written only for a task that is refused."""
        if isinstance(self.source, bytes):
            return self.source
        return json.dumps(self.source).encode()


MAX_BATCH = 1000  # tasks in one batch message, at most
# What the SDK packs into one (SkedClient.submit_many): at most BATCH_TASKS tasks and
# BATCH_BYTES bytes (or half the deployment's SKED_MAX_MESSAGE_BYTES, if less) unless one task
# is larger.
BATCH_TASKS = 100
BATCH_BYTES = 256 * 1024


def pack_batches(entries: Sequence[tuple[bytes, UUID, str | None]], limit: int) -> list[bytes]:
    """(spec JSON, task id, traceparent) entries packed into the bodies of batch messages, in
    order; each spec goes in as it is, not parsed and written again."""
    bodies: list[bytes] = []
    parts: list[bytes] = []
    size = 0

    def close() -> None:
        bodies.append(b'{"schema_version":1,"tasks":[' + b",".join(parts) + b"]}")

    for spec, ident, parent in entries:
        traced = b'"traceparent":"%s",' % parent.encode() if parent else b""
        part = b'{"id":"%s",%s"spec":%s}' % (str(ident).encode(), traced, spec)
        if parts and (len(parts) >= BATCH_TASKS or size + len(part) > limit):
            close()
            parts, size = [], 0
        parts.append(part)
        size += len(part) + 1
    if parts:
        close()
    return bodies


def judge_batch(
    body: bytes,
    content_type: str | None,
    max_bytes: int,
    policy: JobPolicy = JobPolicy(),  # noqa: B008 - immutable
) -> list[Entry] | Rejected:
    """A batch message: `{"tasks": [{"id": UUID, "spec": {...}, "traceparent": ...}, ...]}`.
    A malformed envelope rejects the message whole; a bad task rejects that task alone. Never
    raises, as `judge`."""
    try:
        return _judge_batch(body, content_type, max_bytes, policy)
    except Exception as exc:
        return Rejected(f"unreadable batch message: {one_line(exc)}")


def _judge_batch(
    body: bytes, content_type: str | None, max_bytes: int, policy: JobPolicy
) -> list[Entry] | Rejected:
    data = _read_message(body, content_type, max_bytes)
    if isinstance(data, Rejected):
        return data
    if isinstance(data, dict) and data.get("schema_version", 1) != 1:
        return Rejected(f"schema_version {data['schema_version']!r} is not 1")
    tasks = data.get("tasks") if isinstance(data, dict) else None
    if not isinstance(tasks, list) or not tasks:
        return Rejected('a batch message must be an object with a non-empty list "tasks"')
    if len(tasks) > MAX_BATCH:
        return Rejected(f"a batch of {len(tasks)} tasks: at most {MAX_BATCH} in one message")
    return [_entry(i, item, policy) for i, item in enumerate(tasks)]


def _entry(index: int, item: object, policy: JobPolicy) -> Entry:
    fields = item if isinstance(item, dict) else {}
    spec = fields.get("spec")
    ident = fields.get("id")
    source = spec if spec is not None else item
    message_id = ident if isinstance(ident, str) and len(ident) <= 256 else ""
    parent = header_text(fields, "traceparent", _TRACEPARENT)

    def rejected(reason: str) -> Entry:
        return Entry(Rejected(f"task {index} of a batch: {reason}"), source, message_id, parent)

    if not isinstance(item, dict):
        return rejected(f"an entry must be a JSON object, got {type(item).__name__}")
    try:
        UUID(message_id)
    except ValueError:
        return rejected('its "id" must be a UUID (the task id the producer chose)')
    verdict = _verdict(spec, message_id, policy)
    if isinstance(verdict, Rejected):
        return rejected(verdict.reason)
    return Entry(verdict, source, message_id, parent)


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
    if isinstance(value, str) and len(value) <= 256 and pattern.fullmatch(value):
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
    return same_json(stored, fresh)
