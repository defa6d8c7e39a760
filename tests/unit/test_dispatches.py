"""The dispatch message (shared.dispatches): a node's attempts of one pass in one message, each
entry read alone — a bad entry is refused with its own JSON, the rest are used."""

from __future__ import annotations

import json
from uuid import uuid4

import pytest

from shared.dispatches import (
    MAX_BODY_BYTES,
    MAX_DISPATCHES,
    MAX_PLACED,
    entry_of,
    pack,
    placed,
    unpack,
)
from shared.models import Dispatch, Task
from tests.helpers import task_row


def dispatch(node: str = "n1", attempt: int = 1) -> Dispatch:
    return Dispatch(
        task_id=uuid4(), attempt=attempt, version=4, retry_count=0, max_retries=0, node=node
    )


def test_a_batch_comes_back_entry_by_entry_with_each_entrys_headers() -> None:
    sent = [(dispatch(), {"traceparent": f"00-{i:032x}-{i:016x}-01"}) for i in range(1, 4)]
    entries = unpack(pack(sent))
    assert [(e.dispatch, dict(e.headers)) for e in entries] == sent
    assert all(e.problem is None for e in entries)
    # each entry's raw JSON is a message of that entry alone: what its dead letter carries
    assert unpack(entries[0].raw)[0].dispatch == sent[0][0]


def test_a_batch_is_written_as_compact_json() -> None:
    """pack writes what json.dumps would with compact separators (pydantic's encoder, for
    its speed): the same bytes, so a reader of either kind sees one format."""
    sent = [(dispatch(), {"traceparent": f"00-{i:032x}-{i:016x}-01"}) for i in range(1, 4)]
    sent += [(entry_of(Task.from_row(task_row(node="n1"))), {})]
    body = {
        "schema_version": 1,
        "dispatches": [
            {"dispatch": d.model_dump(mode="json") if isinstance(d, Dispatch) else d, "headers": h}
            for d, h in sent
        ],
    }
    assert pack(sent) == json.dumps(body, separators=(",", ":")).encode()


def test_a_single_dispatch_body_is_a_batch_of_one_with_the_messages_headers() -> None:
    d = dispatch()
    [entry] = unpack(d.model_dump_json().encode(), {"traceparent": "x"})
    assert (entry.dispatch, dict(entry.headers)) == (d, {"traceparent": "x"})


def test_a_bad_entry_is_refused_alone() -> None:
    good = dispatch()
    body = json.loads(pack([(good, {})]))
    body["dispatches"] += [
        {"dispatch": {**good.model_dump(mode="json"), "attempt": -1}},
        {"dispatch": good.model_dump(mode="json"), "extra": 1},
        "not an entry",
    ]
    entries = unpack(json.dumps(body).encode())
    assert entries[0].dispatch == good
    assert [e.dispatch for e in entries[1:]] == [None, None, None]
    assert all((e.problem or "").startswith("unreadable dispatch") for e in entries[1:])
    assert json.loads(entries[3].raw)["dispatches"] == ["not an entry"]


def test_a_malformed_message_is_one_refusal_keeping_the_whole_body() -> None:
    many = {"schema_version": 1, "dispatches": [{}] * (MAX_DISPATCHES + 1)}
    for body in (
        b"{not json",
        b'{"schema_version": 2, "dispatches": []}',
        b'{"schema_version": 1, "dispatches": "all"}',
        b'{"schema_version": 1, "dispatches": []}',
        b'{"schema_version": 1, "dispatches": [], "more": 1}',
        json.dumps(many).encode(),
        b'{"task_id": 1}',
        b"[1, NaN]",
    ):
        [entry] = unpack(body)
        assert entry.dispatch is None, body
        assert (entry.problem or "").startswith("unreadable dispatch"), (body, entry.problem)
        assert entry.raw == body


def test_hostile_headers_are_dropped_and_the_dispatch_kept() -> None:
    d = dispatch()
    for headers in ({"a": 1}, {"a": "x" * 5000}, {str(i): "v" for i in range(50)}, ["x"]):
        body = {"schema_version": 1, "dispatches": [{"dispatch": d.model_dump(mode="json"),
                                                     "headers": headers}]}  # fmt: skip
        [entry] = unpack(json.dumps(body).encode())
        assert (entry.dispatch, dict(entry.headers)) == (d, {})


def test_a_body_past_the_size_bound_is_refused_unparsed() -> None:
    body = b'{"schema_version": 1, "dispatches": [' + b" " * MAX_BODY_BYTES + b"]}"
    [entry] = unpack(body)
    assert entry.dispatch is None
    assert (entry.problem or "").startswith("unreadable dispatch")
    assert entry.raw == body


def test_entry_of_a_placed_task_is_its_dispatchs_json() -> None:
    task = Task.from_row(task_row(node="n7", attempt=3, version=9, retry_count=2, max_retries=5))
    assert entry_of(task) == Dispatch.of(task).model_dump(mode="json")
    [entry] = unpack(pack([(entry_of(task), {"traceparent": "x"})]))
    assert entry.dispatch == Dispatch.of(task)
    assert dict(entry.headers) == {"traceparent": "x"}
    with pytest.raises(ValueError, match="not placed"):
        entry_of(Task.from_row(task_row()))


def told(d: Dispatch) -> str:
    """An entry of a placement notification (sql: placed_payload)."""
    return f"{d.task_id}:{d.version}:{d.attempt}:{d.retry_count}:{d.max_retries}"


def test_a_placement_notification_reads_as_the_nodes_dispatches() -> None:
    sent = [dispatch(), dispatch(attempt=3)]
    entries = placed(" ".join(told(d) for d in sent), "n1")
    assert [e.dispatch for e in entries] == sent
    assert all(e.problem is None and not e.headers for e in entries)
    # the node is the channel's, whatever a payload could say
    assert {e.dispatch.node for e in placed(told(dispatch(node="n9")), "n1") if e.dispatch} == {
        "n1"
    }


@pytest.mark.parametrize(
    "junk",
    [
        "",
        "not-an-entry",
        f"{uuid4()}:4:1:0",  # a field short
        f"{uuid4()}:4:1:0:0:9",  # a field over
        f"{uuid4()}:four:1:0:0",
        f"{uuid4()}:4:0:0:0",  # no attempt 0
        f"{uuid4()}:4:1:-1:0",
        f"{uuid4()}:{2**31}:1:0:0",  # past int4
        "nope:4:1:0:0",
        "9" * 5000 + ":4:1:0:0",
    ],
)
def test_what_is_not_a_placement_entry_is_skipped_and_the_rest_read(junk: str) -> None:
    good = dispatch()
    entries = placed(f"{junk} {told(good)} {junk}", "n1")
    assert [e.dispatch for e in entries] == [good]


def test_a_placement_notification_is_read_up_to_its_bound() -> None:
    entries = placed(" ".join(told(dispatch()) for _ in range(MAX_PLACED + 50)), "n1")
    assert len(entries) == MAX_PLACED
