"""Hostile input and output, judged without servers: every poison class a producer can send is
refused with a reason (never an exception), and every outcome a task can hand back is made
storable. The end-to-end proof that intake survives them is tests/e2e/test_hostile_input.py."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import jsonvalue, lease
from shared.dag import WorkflowSpec
from shared.errors import InvalidSpec
from shared.intake import Accepted, Rejected, judge, same_spec, traceparent
from shared.models import CommandJob, HandlerJob, TaskSpec
from shared.outcome import MAX_RESULT_BYTES, Report, storable
from shared.policy import JobPolicy

GOOD = {"name": "n", "job": {"kind": "command", "argv": ["true"]}}
LIMIT = 1024 * 1024


def with_args(args: str) -> bytes:
    """A handler spec whose args are the raw JSON text `args`."""
    return (
        b'{"name": "n", "job": {"kind": "handler", "handler": "m:f", "args": '
        + args.encode()
        + b"}}"
    )


POISON = [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    (with_args("[" * 70 + "]" * 70), "nested deeper than 64"),
    (with_args("9" * 5000), "malformed JSON"),  # past Python's integer digit limit
    (with_args('"a\\u0000b"'), "job.args holds a NUL character"),
    (b'{"name": "a\\u0000", "job": {"kind": "command", "argv": ["true"]}}', "name holds a NUL"),
    (with_args('{"k\\u0000": 1}'), "a key in job.args holds a NUL"),
    (with_args('"\\ud800"'), "lone surrogate"),
    (with_args("NaN"), "NaN is not a JSON number"),
    (with_args("-Infinity"), "-Infinity is not a JSON number"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"name": "n", "job": {"kind": "command", "argv": ["true"]}, "x": 1}', "x: Extra inputs"),
    (b"", "malformed JSON"),
    (b"null", "must be a JSON object"),
    (b'{"name": "n", "job": {"kind": "command", "argv": ["true"]}, "priority": 1e400}', "priority"),
    (
        json.dumps({**GOOD, "affinity": {f"k{i}": "v" for i in range(65)}}).encode(),
        "affinity",
    ),
    (json.dumps({**GOOD, "affinity": {"k": "v" * 254}}).encode(), "affinity"),
    (
        json.dumps({**GOOD, "selector": {f"k{i}": "v" for i in range(65)}}).encode(),
        "selector",
    ),
    (json.dumps({**GOOD, "selector": {"k": "v" * 254}}).encode(), "selector"),
    (json.dumps({**GOOD, "selector": {"": "v"}}).encode(), "selector"),
]


def test_a_stored_spec_from_before_the_selector_bound_still_reads_back() -> None:
    """The selector's bound refuses new specs only: a task stored with a wider selector must
    still be read (placed, ended, shown), not turn into an unreadable row."""
    wide = json.dumps({**GOOD, "selector": {f"k{i}": "v" for i in range(65)}})
    assert len(TaskSpec.model_validate_json(wide).selector) == 65  # how a stored spec is read
    with pytest.raises(InvalidSpec, match="selector"):
        TaskSpec.parse(wide)


def test_a_workflow_task_s_selector_is_bounded_too() -> None:
    many = {f"k{i}": "v" for i in range(65)}
    with pytest.raises(InvalidSpec, match=r"task 't': .*selector"):
        WorkflowSpec.parse(
            {"name": "w", "tasks": [{"name": "t", "command": ["true"], "selector": many}]}
        )


@pytest.mark.parametrize(("raw", "reason"), POISON)
def test_every_poison_class_is_rejected_with_a_reason(raw: bytes, reason: str) -> None:
    verdict = judge(raw, "application/json", "m", LIMIT)
    assert isinstance(verdict, Rejected)
    assert reason in verdict.reason


@given(st.binary(max_size=300))
def test_judge_never_raises_on_any_bytes(raw: bytes) -> None:
    assert isinstance(judge(raw, "application/json", None, LIMIT), Accepted | Rejected)


@given(
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=30,
    )
)
def test_judge_never_raises_on_any_json_in_a_spec(args: Any) -> None:
    body = json.dumps({**GOOD, "job": {"kind": "handler", "handler": "m:f", "args": args}})
    verdict = judge(body.encode(), "application/json", None, LIMIT)
    if isinstance(verdict, Accepted):  # whatever is accepted can be stored
        assert jsonvalue.problem(verdict.spec.model_dump(mode="json")) is None


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (
            {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
            "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
        ),
        (
            {"traceparent": ("00-" + "a" * 32 + "-" + "b" * 16 + "-01").encode()},
            "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
        ),
        ({"traceparent": 12}, None),
        ({"traceparent": {"nested": "table"}}, None),
        ({"traceparent": b"\xff\xfe"}, None),
        ({"traceparent": "00-nul\x00"}, None),
        ({"traceparent": "x" * 10_000}, None),
        (None, None),
    ],
)
def test_a_header_of_any_type_counts_as_absent_rather_than_failing(
    headers: dict[str, Any] | None, expected: str | None
) -> None:
    assert traceparent(headers) == expected


def test_a_spec_submitted_again_is_the_same_task_whatever_its_priority_became() -> None:
    spec = TaskSpec.parse({**GOOD, "idempotency_key": "k"})
    stored = TaskSpec.parse({**GOOD, "idempotency_key": "k", "priority": 9}).model_dump_json()
    assert same_spec(stored, spec)
    other = TaskSpec.parse({**GOOD, "idempotency_key": "k", "max_retries": 3})
    assert not same_spec(stored, other)


# -- outputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "ok", "stored", "error"),
    [
        (math.nan, False, None, "nan is not a JSON number"),
        ([1, math.inf], False, None, "inf is not a JSON number"),
        ({"a": {1: 2}}, False, None, "key must be a string"),
        ({"x": object()}, False, None, "object is not a JSON type"),
        ({"k\x00": ["v\ud800"]}, True, {"k\\0": ["v\\ud800"]}, None),
        ("x" * (MAX_RESULT_BYTES + 1), False, None, "over the limit"),
        (None, True, None, None),
    ],
)
def test_results_are_made_storable_or_fail_the_attempt_clearly(
    result: Any, ok: bool, stored: Any, error: str | None
) -> None:
    out = storable(Report(ok=True, result=result))
    assert (out.ok, out.result) == (ok, stored)
    if error is not None:
        assert out.error is not None
        assert error in out.error
    assert jsonvalue.problem(out.model_dump(mode="json")) is None


def test_text_is_cleaned_and_cut_with_a_marker() -> None:
    deep: Any = 1
    for _ in range(10_000):
        deep = [deep]
    out = storable(Report(ok=True, result=deep, error="e\x00" * 5000, log_tail="t\x00" * 100_000))
    assert not out.ok
    assert out.error is not None
    assert "nested deeper" in out.error
    assert out.log_tail.startswith("…[cut] ")
    assert len(out.log_tail) <= 64 * 1024
    err = storable(Report(ok=False, error="e\x00" * 5000)).error
    assert err is not None
    assert err.endswith("…[cut]")
    assert "\x00" not in err


@given(st.text())
def test_any_text_becomes_storable(text: str) -> None:
    assert jsonvalue.problem(jsonvalue.clean_text(text)) is None


# -- policy and lease timing -----------------------------------------------------------------


def test_an_allowlist_narrows_what_runs() -> None:
    policy = JobPolicy.of(["myapp", "reports.build"], ["/usr/bin/", "rsync"])
    ok = [
        HandlerJob(handler="myapp:f"),
        HandlerJob(handler="myapp.jobs.x:f"),
        HandlerJob(handler="reports.build:main"),
        CommandJob(argv=["/usr/bin/env"]),
        CommandJob(argv=["/usr/bin/sub/tool"]),
        CommandJob(argv=["rsync", "-a"]),
    ]
    refused = [
        HandlerJob(handler="os:getenv"),
        HandlerJob(handler="myapp2:f"),
        HandlerJob(handler="reports:main"),
        CommandJob(argv=["/bin/sh"]),
        CommandJob(argv=["/usr/bin2/x"]),
        # a directory's programs are judged by their path's prefix only when it is normal
        CommandJob(argv=["/usr/bin/../../bin/sh"]),
        CommandJob(argv=["/usr/bin/./../sbin/x"]),
        CommandJob(argv=["/usr/bin//x"]),
    ]
    assert [policy.refuses(j) for j in ok] == [None] * len(ok)
    assert all(policy.refuses(j) for j in refused)
    assert JobPolicy().refuses(HandlerJob(handler="os:getenv")) is None
    verdict = judge(
        json.dumps({"name": "n", "job": {"kind": "handler", "handler": "os:getenv"}}).encode(),
        None,
        None,
        LIMIT,
        policy,
    )
    assert isinstance(verdict, Rejected)
    assert "handler os:getenv is not allowed here" in verdict.reason


def test_the_watchdog_acts_before_postgres_lets_the_lease_go() -> None:
    for timeout in (1.0, 3.0, 30.0, 600.0):
        g = lease.guard_s(timeout)
        assert 0 < g <= lease.MAX_GUARD_S
        # sent at 100 s, now 100.2 s: runs until 100 + timeout - guard
        assert lease.remaining_s(timeout, 100.0, 100.2) == pytest.approx(timeout - g - 0.2)
    assert lease.renew_every_s(2.0, [30.0]) == 2.0
    assert lease.renew_every_s(2.0, [30.0, 1.0]) == 0.25
    assert lease.renew_every_s(2.0, []) == 2.0


@pytest.mark.parametrize(
    "job",
    [
        {"kind": "command", "argv": ["echo", "x" * 200_000]},  # one argument over 128 KiB
        {"kind": "command", "argv": ["true"], "env": {"BIG": "x" * 200_000}},  # one variable
        {"kind": "command", "argv": ["true"], "env": {f"V{i}": "x" * 100_000 for i in range(24)}},
    ],
)
def test_a_command_execve_would_refuse_is_refused_at_submission(job: dict[str, Any]) -> None:
    """Linux refuses an argument or environment string over 128 KiB (MAX_ARG_STRLEN), and all
    of them over ARG_MAX, with E2BIG at exec: such a command was admitted, then every attempt
    failed to start and was tried again as a launch failure, with no reason that named it.
    Now the spec is refused, naming the size and the limit (found by an adversarial review)."""
    with pytest.raises(InvalidSpec, match="could never start"):
        TaskSpec.parse({"name": "n", "job": job})
