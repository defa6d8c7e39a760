"""A submission's message body as the SDK renders it, refused before it is sent where intake
would dead-letter it (shared.intake judges the same body on the other side)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.errors import InvalidSpec

if TYPE_CHECKING:
    from shared.dag import WorkflowSpec
    from shared.models import TaskSpec

# What a batch message wraps around one spec (its id, trace parent and the envelope): a spec
# this much under the limit fits in a message of its own.
ENVELOPE_BYTES = 256


def rendered(spec: TaskSpec | WorkflowSpec, limit: int) -> bytes:
    """A spec's message body, refused (InvalidSpec, nothing sent) if intake would dead-letter
    it: a NUL or a lone surrogate in any string (Postgres cannot store them), or a message
    over the deployment's limit (SKED_MAX_MESSAGE_BYTES, as this process reads it)."""
    from pydantic_core import PydanticSerializationError

    from shared.jsonvalue import Unsafe, refuse_unsafe

    try:
        body = spec.model_dump_json().encode()
        refuse_unsafe(body)
    except (Unsafe, PydanticSerializationError) as exc:
        raise InvalidSpec(f"{spec.name!r} cannot be stored: {exc}") from None
    if len(body) + ENVELOPE_BYTES > limit:
        raise InvalidSpec(
            f"{spec.name!r} is {len(body)} bytes as JSON: over the limit of a message, "
            f"{limit} bytes less {ENVELOPE_BYTES} (SKED_MAX_MESSAGE_BYTES)"
        )
    return body
