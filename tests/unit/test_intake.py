"""What the scheduler does with a submitted message, and the pieces of pure policy around it."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from uuid import UUID

import pytest

from shared.backoff import retry_delay
from shared.intake import (
    BATCH_TASKS,
    MAX_BATCH,
    Accepted,
    Rejected,
    judge,
    judge_batch,
    pack_batches,
)
from shared.models import TaskSpec, task_id_for
from shared.policy import JobPolicy
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
        (body(GOOD), "application/json; charset=latin-1", "content type"),
        (body(GOOD), "application/jsonx", "content type"),
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


# -- batch messages (submit.batch): the envelope whole, each task alone ----------------------

IDS = [UUID(int=i + 1) for i in range(4)]


def batch(*entries: object) -> bytes:
    return body({"schema_version": 1, "tasks": list(entries)})


def test_a_batch_message_is_judged_task_by_task() -> None:
    parent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    bad = {**GOOD, "priority": "high"}
    entries = judge_batch(
        batch(
            {"id": str(IDS[0]), "spec": GOOD, "traceparent": parent},
            {"id": str(IDS[1]), "spec": bad},
            {"id": "not-a-uuid", "spec": GOOD},
            [1],
            {"id": str(IDS[2]), "spec": {**GOOD, "job": {"kind": "command", "argv": ["rm"]}}},
        ),
        "application/json",
        LIMIT,
        JobPolicy.of([], ["true"]),
    )
    assert isinstance(entries, list)
    first, *rest = entries
    assert first.verdict == Accepted(IDS[0], TaskSpec.parse(GOOD))
    assert (first.message_id, first.traceparent) == (str(IDS[0]), parent)
    reasons = [e.verdict.reason for e in rest if isinstance(e.verdict, Rejected)]
    assert len(reasons) == 4
    assert reasons[0].startswith("task 1 of a batch: ")
    assert "priority" in reasons[0]
    assert "task 2 of a batch" in reasons[1]
    assert "UUID" in reasons[1]
    assert "task 3 of a batch: an entry must be a JSON object" in reasons[2]
    assert "task 4 of a batch" in reasons[3]
    assert "rm" in reasons[3]
    # a refused task is dead-lettered as its own spec, under its own id
    assert json.loads(rest[0].body) == bad
    assert rest[0].message_id == str(IDS[1])


@pytest.mark.parametrize(
    ("raw", "content_type", "reason"),
    [
        (b"{not json", "application/json", "malformed JSON"),
        (body([GOOD]), "application/json", 'non-empty list "tasks"'),
        (body({"tasks": []}), "application/json", 'non-empty list "tasks"'),
        (body({"tasks": GOOD}), "application/json", 'non-empty list "tasks"'),
        (body({"schema_version": 2, "tasks": [GOOD]}), "application/json", "schema_version 2"),
        (batch(*[GOOD] * (MAX_BATCH + 1)), "application/json", f"at most {MAX_BATCH}"),
        (batch({"id": str(IDS[0]), "spec": GOOD}), "text/plain", "content type"),
        (b"[" * 10_000, "application/json", "nested deeper"),
    ],
)
def test_a_bad_batch_envelope_rejects_the_message_whole(
    raw: bytes, content_type: str, reason: str
) -> None:
    verdict = judge_batch(raw, content_type, 64 * LIMIT)
    assert isinstance(verdict, Rejected)
    assert reason in verdict.reason


def test_the_sdk_packs_batches_that_intake_reads_back() -> None:
    specs = [TaskSpec.parse({**GOOD, "name": f"t{i}"}) for i in range(BATCH_TASKS + 5)]
    ids = [UUID(int=i + 1) for i in range(len(specs))]
    entries = [(s.model_dump_json().encode(), i, None) for s, i in zip(specs, ids, strict=True)]
    by_count = pack_batches(entries, LIMIT)
    assert [m.count(b'"spec"') for m in by_count] == [BATCH_TASKS, 5]
    size = len(entries[0][0]) * 3  # about three tasks' worth of bytes a message
    by_size = pack_batches(entries, size)
    assert all(m.count(b'"spec"') <= 3 for m in by_size)
    for messages in (by_count, by_size):
        read = []
        for m in messages:
            judged = judge_batch(m, "application/json", LIMIT)
            assert isinstance(judged, list)
            read += [e.verdict for e in judged]
        assert read == [Accepted(i, s) for i, s in zip(ids, specs, strict=True)]


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


@pytest.mark.parametrize(
    "content_type",
    ["application/json; charset=utf-8", "Application/JSON", 'application/json;charset="UTF8"'],
)
def test_json_as_clients_spell_it_is_read(content_type: str) -> None:
    """Many AMQP clients name the charset; the media type is case-insensitive."""
    assert not isinstance(judge(body(GOOD), content_type, None, LIMIT), Rejected)
