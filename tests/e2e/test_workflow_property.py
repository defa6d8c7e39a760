"""A property over random workflows run end to end: random DAGs (fan-out, fan-in, chains, all
three edge conditions) whose tasks randomly succeed, fail, or fail once and succeed on retry.

For every example: every task ends terminal; a task that ran started only after each upstream
it needs had finished (its last attempt's end stamp, from the tasks' own output); and the final
states are exactly those of a reference model written here from the rules of brief §7 —
independent of shared.dag, so the test cannot agree with the scheduler by construction.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.client import SkedClient
from shared.fsm import State
from shared.views import is_done
from tests.e2e.checks import check_all_histories
from tests.e2e.conftest import Deployment
from tests.faults.checks import read_stamps

CONDITIONS = ("on_success", "on_failure", "always")
OUTCOMES = ("ok", "fail", "flaky")  # flaky: attempt 1 fails, attempt 2 succeeds


@dataclass(frozen=True)
class Node:
    name: str
    needs: tuple[tuple[str, str], ...]  # (upstream name, condition)
    outcome: str


@st.composite
def workflows(draw: st.DrawFn) -> list[Node]:
    """Tasks t0..tn-1, each needing up to three earlier ones (so never a cycle)."""
    n = draw(st.integers(min_value=1, max_value=9))
    nodes = []
    for i in range(n):
        ups = draw(st.lists(st.integers(0, i - 1), unique=True, max_size=3)) if i else []
        needs = tuple((f"t{u}", draw(st.sampled_from(CONDITIONS))) for u in sorted(ups))
        nodes.append(Node(f"t{i}", needs, draw(st.sampled_from(OUTCOMES))))
    return nodes


def expected_states(nodes: list[Node]) -> dict[str, State]:
    """The reference model: a task runs when every edge's condition holds for its finished
    upstream (on_success: it succeeded; on_failure: it failed; always: it finished in any way,
    skipped included); when one cannot hold, it is Skipped. A flaky task succeeds on retry."""
    final: dict[str, State] = {}
    for node in nodes:  # t0..tn-1 is a topological order
        holds = {
            "on_success": lambda s: s is State.SUCCESS,
            "on_failure": lambda s: s is State.FAILED,
            "always": lambda s: True,
        }
        if all(holds[cond](final[up]) for up, cond in node.needs):
            final[node.name] = State.FAILED if node.outcome == "fail" else State.SUCCESS
        else:
            final[node.name] = State.SKIPPED
    return final


def task_of(node: Node, stamps: Path) -> dict[str, Any]:
    check = {"ok": "true", "fail": "false", "flaky": '[ "$SKED_ATTEMPT" -ge 2 ]'}[node.outcome]
    stamp = f'echo "$SKED_ATTEMPT {{}} $(date +%s.%N)" >> {stamps}/$SKED_TASK_ID'
    script = f"{stamp.format('start')}; {check}; rc=$?; {stamp.format('end')}; exit $rc"
    return {
        "name": node.name,
        "command": ["sh", "-c", script],
        "needs": [{"task": up, "condition": cond} for up, cond in node.needs],
        "max_retries": 1 if node.outcome == "flaky" else 0,
        "backoff_base_s": 0.05,
        "backoff_cap_s": 0.1,
    }


async def first_event_at(pool: asyncpg.Pool, task_id: uuid.UUID, to_status: str) -> Any:
    at = await pool.fetchval(
        "SELECT min(at) FROM task_events WHERE task_id = $1 AND to_status = $2", task_id, to_status
    )
    assert at is not None, f"{task_id} never entered {to_status}"
    return at


@settings(
    max_examples=12,
    deadline=None,
    derandomize=False,
    # one deployment serves every example: each submits its own workflow to it
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(nodes=workflows())
async def test_random_workflows_end_as_the_rules_say(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    tmp_path: Path,
    nodes: list[Node],
) -> None:
    if not deployment.procs:
        await deployment.start("scheduler")
        await deployment.executor("w", 4)
    stamps = tmp_path / uuid.uuid4().hex
    stamps.mkdir()
    workflow_id = await client.submit_workflow(
        {"name": "random", "tasks": [task_of(n, stamps) for n in nodes]}
    )
    view = await client.wait_workflow(workflow_id, timeout=60)
    tasks = {t.wf_task: t for t in view.tasks}
    assert all(is_done(t) for t in view.tasks), view.counts()

    # final states, Skipped exactly where the conditions say
    actual = {name: t.status for name, t in tasks.items()}
    assert actual == expected_states(nodes), [(n.name, n.needs, n.outcome) for n in nodes]

    # nothing ran that was skipped; nothing ran before a needed upstream had finished
    runs = read_stamps(stamps)
    for node in nodes:
        task = tasks[node.name]
        mine = runs.get(str(task.id), [])
        if task.status is State.SKIPPED:
            assert not mine, f"{node.name} was skipped but ran"
            continue
        assert mine, f"{node.name} ended {task.status.label} without running"
        assert all(r.end is not None for r in mine)
        for a, b in itertools.pairwise(sorted(mine, key=lambda r: r.start)):
            assert a.end is not None
            assert a.end <= b.start, f"{node.name}: attempts overlap"
        first_start = min(r.start for r in mine)
        for up, _ in node.needs:
            upstream = tasks[up]
            ups = runs.get(str(upstream.id), [])
            if ups:  # it ran: its last attempt ended before this one started
                last_end = max(r.end for r in ups if r.end is not None)
                assert last_end <= first_start, f"{node.name} started before {up} ended"
            else:  # skipped: the skip was recorded before this one first started
                skipped_at = await first_event_at(pool, upstream.id, "skipped")
                assert skipped_at <= await first_event_at(pool, task.id, "running")
    await check_all_histories(pool)
