"""Workflow validation, cycle naming, priority inheritance and edge conditions (pure)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.dag import (
    Condition,
    Verdict,
    WorkflowSpec,
    decide,
    effective_priorities,
    inputs_of,
    output_of,
    topological_order,
)
from shared.errors import InvalidSpec
from shared.fsm import State


def wf(*tasks: dict[str, Any], resources: dict[str, int] | None = None) -> dict[str, Any]:
    return {"name": "w", "resources": resources or {}, "tasks": list(tasks)}


def cmd(name: str, *needs: Any, **kw: Any) -> dict[str, Any]:
    return {"name": name, "command": ["true"], "needs": list(needs), **kw}


def test_the_issue_example_parses() -> None:
    spec = WorkflowSpec.parse(
        {
            "name": "nightly-report",
            "resources": {"gpu-slot": 2},
            "tasks": [
                {"name": "extract", "command": ["python", "extract.py"], "priority": 5},
                {"name": "backup", "command": ["sh", "-c", "pg_dump app > /backups/app.sql"]},
                {
                    "name": "report",
                    "handler": "reports.build:main",
                    "needs": [
                        "extract",
                        {
                            "task": "backup",
                            "condition": "always",
                            "timeout_s": 600,
                            "on_timeout": "default",
                            "default": {},
                        },
                    ],
                    "uses": ["gpu-slot"],
                },
            ],
        }
    )
    report = spec.tasks[2]
    assert [e.task for e in report.needs] == ["extract", "backup"]
    assert report.needs[1].condition is Condition.ALWAYS
    assert spec.tasks[0].spec().priority == 5
    assert spec.check().index("report") > spec.check().index("backup")


@pytest.mark.parametrize("length", [1, 2, 50])
def test_cycles_are_named(length: int) -> None:
    names = [f"t{i}" for i in range(length)]
    tasks = [cmd(n, names[(i + 1) % length]) for i, n in enumerate(names)]
    with pytest.raises(InvalidSpec, match="cycle") as err:
        WorkflowSpec.parse(wf(*tasks))
    text = str(err.value)
    path = text.split(": ", 1)[1].split(" -> ")
    assert path[0] == path[-1]
    assert sorted(path[:-1]) == sorted(names)
    # each named step really is an edge: the later needs the earlier
    needs = {n: names[(i + 1) % length] for i, n in enumerate(names)}
    for upstream, downstream in itertools.pairwise(path):
        assert needs[downstream] == upstream


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (wf(cmd("a"), cmd("a")), "two tasks are named 'a'"),
        (wf(cmd("a", "nope")), "needs unknown task 'nope'"),
        (wf(cmd("a", uses=["gpu"])), "undeclared resource 'gpu'"),
        (wf({"name": "a"}), "exactly one of command or handler"),
        (wf(cmd("a", priority="high")), "task 'a'.*priority"),
        (wf(cmd("a"), resources={"r": 0}), "capacity must be at least 1"),
        ({"name": "w", "tasks": []}, "tasks"),
        (wf(cmd("a", {"task": "b", "condition": "sometimes"}), cmd("b")), "condition"),
        # pydantic's lax mode read true as 1 and "2" as 2: JSON numbers only
        (wf(cmd("a", {"task": "b", "timeout_s": True}), cmd("b")), "timeout_s.*JSON number"),
        (wf(cmd("a", uses=["r"]), resources={"r": "2"}), "resources.*JSON integer"),
        (wf(cmd("a", priority=True)), "priority.*JSON integer"),
        # its handler would get `inputs` twice, and fail alike on every retry
        (
            wf(cmd("b"), {"name": "a", "handler": "m:f", "args": {"inputs": 1}, "needs": ["b"]}),
            "task 'a': args cannot name 'inputs'",
        ),
    ],
)
def test_bad_workflows_are_rejected_whole(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpec, match=message):
        WorkflowSpec.parse(spec)


def test_priority_inheritance_is_transitive() -> None:
    needs = {"a": [], "b": ["a"], "c": ["b"], "x": []}
    own = {"a": 0, "b": 1, "c": 9, "x": 5}
    assert effective_priorities(own, needs) == {"a": 9, "b": 9, "c": 9, "x": 5}


@pytest.mark.parametrize(
    ("edges", "verdict"),
    [
        ([(Condition.ON_SUCCESS, State.SUCCESS)], Verdict.READY),
        ([(Condition.ON_SUCCESS, State.FAILED)], Verdict.SKIP),
        ([(Condition.ON_SUCCESS, State.SKIPPED)], Verdict.SKIP),
        ([(Condition.ON_FAILURE, State.FAILED)], Verdict.READY),
        ([(Condition.ON_FAILURE, State.TIMED_OUT)], Verdict.READY),
        ([(Condition.ON_FAILURE, State.SUCCESS)], Verdict.SKIP),
        ([(Condition.ALWAYS, State.SKIPPED)], Verdict.READY),
        ([(Condition.ALWAYS, State.CANCELED)], Verdict.READY),
        ([(Condition.ALWAYS, State.RUNNING)], Verdict.WAIT),
        ([(Condition.ALWAYS, State.PAUSED)], Verdict.WAIT),
        (
            [(Condition.ON_SUCCESS, State.SUCCESS), (Condition.ALWAYS, State.RETRY_WAIT)],
            Verdict.WAIT,
        ),
        (
            [(Condition.ON_SUCCESS, State.RUNNING), (Condition.ON_SUCCESS, State.FAILED)],
            Verdict.SKIP,
        ),
        ([], Verdict.READY),
    ],
)
def test_edge_conditions(edges: list[tuple[Condition, State]], verdict: Verdict) -> None:
    assert decide(edges)[0] is verdict


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_dags_order_upstream_first(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 30))
    names = [f"n{i}" for i in range(n)]
    # edges only from lower to higher index: acyclic by construction
    needs = {
        names[j]: data.draw(st.lists(st.sampled_from(names[:j]), unique=True)) if j else []
        for j in range(n)
    }
    order = topological_order(needs)
    position = {name: i for i, name in enumerate(order)}
    for task, ups in needs.items():
        assert all(position[u] < position[task] for u in ups)
    own = {name: data.draw(st.integers(-5, 5)) for name in names}
    eff = effective_priorities(own, needs)
    for task, ups in needs.items():
        assert eff[task] >= own[task]
        assert all(eff[u] >= eff[task] for u in ups)


def test_a_dumped_workflow_parses_back_the_same() -> None:
    spec = WorkflowSpec.parse(wf(cmd("a", priority=3, max_retries=2), cmd("b", "a")))
    again = WorkflowSpec.parse(spec.model_dump(mode="json"))
    assert again == spec
    assert again.tasks[0].spec().priority == 3


@pytest.mark.parametrize(
    ("policy", "verdict"),
    [("skip", Verdict.READY), ("default", Verdict.READY), ("fail", Verdict.FAIL)],
)
def test_a_timed_out_dependency_follows_its_policy(policy: str, verdict: Verdict) -> None:
    edges = [(Condition.ON_SUCCESS, State.SUCCESS), (Condition.ON_SUCCESS, State.PAUSED, policy)]
    got, why = decide(edges)
    assert got is verdict
    assert f"policy {policy}" in why


def edge(name: str, status: State, kind: str = "handler", result: Any = None, **kw: Any) -> Any:
    base = {"policy": None, "default_value": None}
    return {
        **base,
        "upstream_name": name,
        "status": status.value,
        "upstream_kind": kind,
        "upstream_result": result,
        **kw,
    }


def test_outputs_handed_downstream() -> None:
    assert output_of("handler", {"rows": 3}) == {"rows": 3}
    assert output_of("handler", None) is None
    assert output_of("command", {"exit_code": 0, "output": [1, 2]}) == [1, 2]
    assert output_of("command", {"exit_code": 0}) is None  # declared nothing


def test_inputs_of_a_released_task() -> None:
    inputs = inputs_of(
        [
            edge("extract", State.SUCCESS, result={"rows": 3}),
            edge("build", State.SUCCESS, "command", {"exit_code": 0, "output": "ok"}),
            edge("bare", State.SUCCESS, "command", {"exit_code": 0}),
            edge("late", State.RUNNING, policy="default", default_value={"rows": 0}),
            edge("slow", State.RUNNING, policy="skip"),
            edge("broken", State.FAILED, result=None),
            edge("dropped", State.SKIPPED),
        ]
    )
    assert inputs == {"extract": {"rows": 3}, "build": "ok", "bare": None, "late": {"rows": 0}}
