"""A message in sked.dead (shared.bus.DEAD_QUEUE) as an operator reads it: light to import,
for the CLI and the API, which show dead letters without speaking AMQP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REASON_HEADER = "x-sked-reason"  # why sked dead-lettered a message


DEAD_PREVIEW = 500  # characters of a dead letter's body shown to an operator


@dataclass(frozen=True)
class DeadLetter:
    """A message in DEAD_QUEUE as an operator reads it. Every field comes from a message
    anyone may have published, so each is read defensively and bounded."""

    reason: str  # x-sked-reason; or RabbitMQ's own (x-death) for a message it dead-lettered
    routing_key: str  # the key it was first published with
    message_id: str | None
    size: int  # the body's bytes
    body: str  # its first DEAD_PREVIEW characters, decoded (what is not UTF-8 replaced)

    def as_json(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "routing_key": self.routing_key,
            "message_id": self.message_id,
            "size": self.size,
            "body": self.body,
        }


def dead_letter_of(
    body: bytes, headers: Any, routing_key: str | None, message_id: str | None
) -> DeadLetter:
    """A DeadLetter from a message's parts, whatever their types: a header that is not what
    sked writes counts as absent."""
    headers = headers if isinstance(headers, dict) else {}
    reason = headers.get(REASON_HEADER)
    key = headers.get("x-sked-routing-key")
    if not isinstance(reason, str):  # dead-lettered by RabbitMQ (sked.submit's DLX), or forged
        deaths = headers.get("x-death")
        death = deaths[0] if isinstance(deaths, list) and deaths else {}
        why = death.get("reason") if isinstance(death, dict) else None
        reason = f"dead-lettered by RabbitMQ: {why}" if isinstance(why, str) else "no reason given"
    return DeadLetter(
        reason[:2000],
        (key if isinstance(key, str) else routing_key or "")[:255],
        message_id[:255] if isinstance(message_id, str) else None,
        len(body),
        body[: DEAD_PREVIEW * 4].decode("utf-8", errors="replace")[:DEAD_PREVIEW],
    )
