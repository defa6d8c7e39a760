"""What the scheduler does with a submitted message, and the pieces of pure policy around it."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from uuid import UUID

import pytest

from shared.backoff import retry_delay
from shared.intake import Accepted, Rejected, judge
from shared.models import TaskSpec, task_id_for
from shared.queues import score

GOOD = {"name": "n", "job": {"kind": "command", "argv": ["true"]}}
LIMIT = 1024 * 1024


def body(data: object) -> bytes:
    return json.dumps(data).encode()


def test_a_valid_message_is_accepted_with_its_message_id() -> None:
    mid = "0b0f6c3e-58b3-4c8e-9a55-1d3c7f0e9f10"
    verdict = judge(body(GOOD), "application/json", mid, LIMIT)
    assert isinstance(verdict, Accepted)
    assert verdict.task_id == UUID(mid)


@pytest.mark.parametrize(
    ("raw", "content_type", "reason"),
    [
        (b"{not json", "application/json", "malformed JSON"),
        (body([1, 2]), "application/json", "must be a JSON object"),
        (body({"job": GOOD["job"]}), "application/json", "name: Field required"),
        (body({**GOOD, "priority": "high"}), "application/json", "priority"),
        (body({**GOOD, "surprise": 1}), "application/json", "surprise: Extra inputs"),
        (body(GOOD), "text/plain", "content type 'text/plain'"),
        (b"x" * (LIMIT + 1), "application/json", f"exceeds the limit of {LIMIT} bytes"),
        (b"\xff\xfe", "application/json", "malformed JSON"),
    ],
)
def test_bad_messages_are_rejected_with_a_reason(
    raw: bytes, content_type: str, reason: str
) -> None:
    verdict = judge(raw, content_type, None, LIMIT)
    assert isinstance(verdict, Rejected)
    assert reason in verdict.reason


def test_task_ids_are_stable_per_submission() -> None:
    spec = TaskSpec.parse(GOOD)
    assert task_id_for(spec, "m-1") == task_id_for(spec, "m-1") != task_id_for(spec, "m-2")
    keyed = TaskSpec.parse({**GOOD, "idempotency_key": "k"})
    assert task_id_for(keyed, "a") == task_id_for(keyed, "b")
    assert task_id_for(spec, None) != task_id_for(spec, None)


def test_backoff_is_capped_exponential_with_jitter() -> None:
    rnd = random.Random(7)
    for spent in range(12):
        ceiling = min(60.0, 1.0 * 2**spent)
        for _ in range(50):
            d = retry_delay(spent, 1.0, 60.0, rnd)
            assert ceiling / 2 <= d <= ceiling
    assert retry_delay(1000, 1.0, 60.0) <= 60.0


def test_queue_score_orders_priority_then_fifo_and_ages() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    aging = 2.0
    high, low = 5, 0
    assert score(high, t0, aging) < score(low, t0, aging)
    assert score(low, t0, aging) < score(low, t0 + timedelta(milliseconds=1), aging)
    # a low task queued at t0 goes before any high task queued after t0 + (5 - 0) * 2 s
    assert score(low, t0, aging) < score(high, t0 + timedelta(seconds=10.001), aging)
    assert score(low, t0, aging) > score(high, t0 + timedelta(seconds=9.999), aging)
