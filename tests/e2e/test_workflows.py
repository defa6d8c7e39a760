"""Workflows end to end: order and parallelism from the tasks' own stamps, conditions and
skip propagation, cycles rejected whole, a 1,000-way fan-in released exactly once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import yaml

from shared.bus import DEAD_QUEUE, REASON_HEADER, TASKS_EXCHANGE, WORKFLOW_KEY
from shared.client import SkedClient
from shared.errors import NotFound
from shared.fsm import State
from shared.settings import Settings
from tests.e2e.checks import check_all_histories
from tests.e2e.conftest import Deployment
from tests.faults.checks import read_stamps
from tests.helpers import SKED, eventually


def stamp(name: str, d: Path, ms: float, *needs: Any, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "handler": "tests.faults.jobs:stamp",
        "args": {"dir": str(d), "ms": ms},
        "needs": list(needs),
        **kw,
    }


def command(name: str, argv: list[str], *needs: Any, **kw: Any) -> dict[str, Any]:
    return {"name": name, "command": argv, "needs": list(needs), **kw}


async def test_the_diamond_runs_in_order_with_b_and_c_in_parallel(
    deployment: Deployment, client: SkedClient, tmp_path: Path, pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler")
    await deployment.executor("w", 2)
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    workflow_id = await client.submit_workflow(
        {
            "name": "diamond",
            "tasks": [
                stamp("A", stamps, 200),
                stamp("B", stamps, 500, "A"),
                stamp("C", stamps, 500, "A"),
                stamp("D", stamps, 200, "B", "C"),
                stamp("E", stamps, 200, "D"),
            ],
        }
    )
    view = await client.wait_workflow(workflow_id, timeout=60)
    assert view.status() == "succeeded", view.counts()
    runs = read_stamps(stamps)
    by_name = {t.wf_task: runs[str(t.id)][0] for t in view.tasks}
    a, b, c, d, e = (by_name[n] for n in "ABCDE")
    assert all(r.end is not None for r in by_name.values())
    assert a.end <= b.start  # type: ignore[operator]
    assert a.end <= c.start  # type: ignore[operator]
    assert b.start < c.end, "B and C did not overlap"  # type: ignore[operator]
    assert c.start < b.end, "B and C did not overlap"  # type: ignore[operator]
    assert max(b.end, c.end) <= d.start  # type: ignore[type-var, operator]
    assert d.end <= e.start  # type: ignore[operator]
    await check_all_histories(pool)


async def test_conditions_and_skip_propagation(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler")
    await deployment.executor("w", 2)
    workflow_id = await client.submit_workflow(
        {
            "name": "conditional",
            "tasks": [
                command("A", ["false"]),
                command("on-failure", ["true"], {"task": "A", "condition": "on_failure"}),
                command("on-success", ["true"], "A"),
                command(
                    "after-skip-always", ["true"], {"task": "on-success", "condition": "always"}
                ),
                command("after-skip", ["true"], "on-success"),
            ],
        }
    )
    view = await client.wait_workflow(workflow_id, timeout=60)
    states = {t.wf_task: t.status for t in view.tasks}
    assert states == {
        "A": State.FAILED,
        "on-failure": State.SUCCESS,
        "on-success": State.SKIPPED,
        "after-skip-always": State.SUCCESS,
        "after-skip": State.SKIPPED,
    }
    skipped = next(t for t in view.tasks if t.wf_task == "on-success")
    assert "on_success cannot hold: upstream Failed" in skipped.status_reason
    assert view.status() == "failed"
    await check_all_histories(pool)


def cycle(length: int) -> dict[str, Any]:
    names = [f"t{i}" for i in range(length)]
    return {
        "name": f"cycle-{length}",
        "tasks": [command(n, ["true"], names[(i + 1) % length]) for i, n in enumerate(names)],
    }


async def test_cycles_are_rejected_whole_with_the_cycle_named(
    deployment: Deployment,
    service_env: dict[str, str],
    settings: Settings,
    tmp_path: Path,
    pool: asyncpg.Pool,
) -> None:
    await deployment.start("scheduler")
    for length in (1, 2, 50):
        path = tmp_path / f"cycle-{length}.yaml"
        path.write_text(yaml.safe_dump(cycle(length)))
        out = subprocess.run(
            [SKED, "submit-workflow", str(path)],
            env=service_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out
        assert "cycle: " in out.stderr
        named = out.stderr.strip().split("cycle: ", 1)[1].split(" -> ")
        assert named[0] == named[-1]
        assert len(named) == length + 1
    # a producer that skips the SDK: the scheduler dead-letters it, and writes nothing
    connection = await aio_pika.connect_robust(settings.rabbitmq_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(TASKS_EXCHANGE)
        await exchange.publish(
            aio_pika.Message(json.dumps(cycle(3)).encode(), content_type="application/json"),
            routing_key=WORKFLOW_KEY,
        )
        dead = await channel.get_queue(DEAD_QUEUE)
        message = None
        for _ in range(100):
            message = await dead.get(timeout=10, fail=False)
            if message is not None:
                break
            await __import__("asyncio").sleep(0.1)
        assert message is not None, "the cyclic workflow was not dead-lettered"
        assert "cycle: " in str(message.headers[REASON_HEADER])
        await message.ack()
    assert await pool.fetchval("SELECT count(*) FROM workflows") == 0
    assert await pool.fetchval("SELECT count(*) FROM tasks") == 0


async def test_a_fan_in_of_a_thousand_releases_the_downstream_once(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler")
    for node in ("f1", "f2"):
        await deployment.executor(node, 8)
    ups = [{"name": f"u{i}", "handler": "tests.e2e.jobs:noop"} for i in range(1000)]
    join = {"name": "join", "handler": "tests.e2e.jobs:noop", "needs": [u["name"] for u in ups]}
    workflow_id = await client.submit_workflow({"name": "fan-in", "tasks": [*ups, join]})
    view = await client.wait_workflow(workflow_id, timeout=180)
    assert view.status() == "succeeded", view.counts()
    downstream = next(t for t in view.tasks if t.wf_task == "join")
    released = await pool.fetchval(
        "SELECT count(*) FROM task_events WHERE task_id = $1 AND to_status = 'ready'",
        downstream.id,
    )
    assert released == 1
    last_up = max(t.finished_at for t in view.tasks if t.wf_task != "join")
    assert downstream.started_at > last_up  # type: ignore[operator]


async def test_workflow_status_json_and_dot(
    deployment: Deployment, client: SkedClient, service_env: dict[str, str]
) -> None:
    await deployment.start("scheduler")
    await deployment.executor("w", 2)
    workflow_id = await client.submit_workflow(
        {"name": "small", "tasks": [command("a", ["true"]), command("b", ["true"], "a")]}
    )
    await client.wait_workflow(workflow_id, timeout=60)

    def sked(*args: str) -> str:
        out = subprocess.run(
            [SKED, *args], env=service_env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out
        return out.stdout

    status = json.loads(sked("workflow", str(workflow_id), "--json"))
    assert status["status"] == "succeeded"
    assert status["counts"] == {"success": 2}
    assert {t["name"] for t in status["tasks"]} == {"a", "b"}
    dot = sked("workflow", str(workflow_id), "--dot")
    assert dot.startswith('digraph "small"')
    assert '"a" -> "b";' in dot
    assert "Success" in dot
    task_b = next(t for t in status["tasks"] if t["name"] == "b")
    assert f"workflow:  {workflow_id} (task b)" in sked("status", task_b["id"])


async def test_a_low_upstream_of_a_high_task_runs_before_unrelated_mid_tasks(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler")
    mids = await client.submit_many(
        [
            {"name": f"mid-{i}", "job": {"kind": "command", "argv": ["true"]}, "priority": 5}
            for i in range(5)
        ]
    )
    workflow_id = await client.submit_workflow(
        {
            "name": "inherit",
            "tasks": [
                command("low", ["true"], priority=0),
                command("high", ["true"], "low", priority=10),
            ],
        }
    )

    async def all_waiting() -> bool:
        n = await pool.fetchval("SELECT count(*) FROM tasks WHERE status IN ('ready', 'pending')")
        return n == 7

    await eventually(all_waiting, timeout=30, what="everything submitted and waiting")
    await deployment.executor("one", 1)  # one slot: the order is the queue's order
    view = await client.wait_workflow(workflow_id, timeout=60)
    done = await client.wait_all(mids, timeout=60)
    low = next(t for t in view.tasks if t.wf_task == "low")
    assert low.priority == 10  # inherited from its high downstream
    assert all(low.started_at < t.started_at for t in done.values())  # type: ignore[operator]


async def test_a_resource_of_capacity_two_is_never_held_by_more(
    deployment: Deployment, client: SkedClient, tmp_path: Path, pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler")
    await deployment.executor("w", 8)
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    holders = [stamp(f"r{i}", stamps, 300, uses=["gpu-slot"]) for i in range(6)]
    failing = command("r-fails", ["sh", "-c", "sleep 0.3; exit 1"], uses=["gpu-slot"])
    canceled = command("r-canceled", ["sleep", "30"], uses=["gpu-slot"])
    free = stamp("free", stamps, 100)  # needs no resource: never held back
    workflow_id = await client.submit_workflow(
        {
            "name": "resources",
            "resources": {"gpu-slot": 2},
            "tasks": [canceled, failing, *holders, free],
        }
    )

    async def canceled_running() -> Any:
        try:
            view = await client.workflow(workflow_id)
        except NotFound:  # its submission is still on its way
            return None
        task = next(t for t in view.tasks if t.wf_task == "r-canceled")
        return task if task.status is State.RUNNING else None

    running = await eventually(canceled_running, timeout=60, what="r-canceled holding a unit")
    await client.cancel(running.id, "release the unit")
    view = await client.wait_workflow(workflow_id, timeout=120)
    states = {t.wf_task: t.status for t in view.tasks}
    assert states["r-canceled"] is State.CANCELED
    assert states["r-fails"] is State.FAILED
    assert all(states[f"r{i}"] is State.SUCCESS for i in range(6))
    # from the holders' own stamps: never more than 2 at once
    runs = read_stamps(stamps)
    names = {str(t.id): t.wf_task for t in view.tasks}
    intervals = [(r.start, r.end) for tid, rs in runs.items() if names[tid] != "free" for r in rs]
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    level = peak = 0
    for _, delta in points:
        level += delta
        peak = max(peak, level)
    assert peak <= 2, f"{peak} holders at once"
    # and from our records: the reservations (Scheduling .. terminal) of the units
    held = await pool.fetch(
        """
        SELECT e.task_id, min(e.at) FILTER (WHERE e.to_status = 'scheduling') AS s,
               max(e.at) AS f
        FROM task_events e JOIN tasks t ON t.id = e.task_id
        WHERE t.workflow_id = $1 AND t.uses <> '{}'
        GROUP BY e.task_id
        """,
        workflow_id,
    )
    spans = [(r["s"], r["f"]) for r in held if r["s"] is not None]
    points2 = sorted([(s, 1) for s, _ in spans] + [(f, -1) for _, f in spans])
    level = peak = 0
    for _, delta in points2:
        level += delta
        peak = max(peak, level)
    assert peak <= 2, f"{peak} units reserved at once"
    await check_all_histories(pool)


async def test_dependency_timeouts_follow_their_policy_on_a_paused_upstream(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    await deployment.start("scheduler", env={"SKED_RECONCILE_S": "0.3"})
    await deployment.executor("w", 4)
    stuck = command("stuck", ["sleep", "60"], selector={"zone": "nowhere"})  # never placed

    def after(name: str, **edge: Any) -> dict[str, Any]:
        # hands its inputs on as its output, so the test sees what it was given
        echo = ["sh", "-c", 'cp "$SKED_INPUTS" "$SKED_OUTPUT"']
        return command(name, echo, {"task": "stuck", "timeout_s": 1.0, **edge})

    workflow_id = await client.submit_workflow(
        {
            "name": "timeouts",
            "tasks": [
                stuck,
                after("skips", on_timeout="skip"),
                after("defaults", on_timeout="default", default={"x": 1}),
                after("fails", on_timeout="fail"),
                command("waits", ["true"], "stuck"),  # no timeout: waits, does not fail
            ],
        }
    )

    async def stuck_task() -> Any:
        try:
            view = await client.workflow(workflow_id)
        except NotFound:
            return None
        return next((t for t in view.tasks if t.wf_task == "stuck"), None)

    upstream = await eventually(stuck_task, timeout=30, what="the workflow admitted")
    await client.pause(upstream.id, "hold the upstream")

    async def decided() -> Any:
        view = await client.workflow(workflow_id)
        states = {t.wf_task: t.status for t in view.tasks}
        done = all(
            states[n] in (State.SUCCESS, State.FAILED) for n in ("skips", "defaults", "fails")
        )
        return view if done else None

    view = await eventually(decided, timeout=30, what="the three timeouts to act")
    states = {t.wf_task: t for t in view.tasks}
    assert states["skips"].status is State.SUCCESS
    assert states["defaults"].status is State.SUCCESS
    assert states["defaults"].inputs == {"stuck": {"x": 1}}  # went on with the default
    assert states["defaults"].result == {"exit_code": 0, "output": {"stuck": {"x": 1}}}
    assert states["skips"].inputs == {}  # went on without it
    assert states["fails"].status is State.FAILED
    assert "timed out (policy fail)" in (states["fails"].error or "")
    assert states["waits"].status is State.PENDING  # a paused upstream: it waits
    assert states["stuck"].status is State.PAUSED
    # each timeout is recorded, and named in the task's next event
    recorded = await pool.fetchval(
        "SELECT count(*) FROM task_deps WHERE timed_out_at IS NOT NULL AND upstream_id = $1",
        upstream.id,
    )
    assert recorded == 3
    for name, policy in (("skips", "skip"), ("defaults", "default"), ("fails", "fail")):
        reasons = [e.reason for e in await client.history(states[name].id)]
        assert any(f"timed out (policy {policy})" in r for r in reasons), reasons
    await client.cancel(upstream.id)
    final = await client.wait_workflow(workflow_id, timeout=30)
    assert {t.wf_task: t.status for t in final.tasks}["waits"] is State.SKIPPED
    await check_all_histories(pool)


async def test_results_flow_downstream(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    """A handler's return value and a command's declared output reach the tasks after them,
    through a fan-in; a skipped or failed upstream hands nothing down."""
    await deployment.start("scheduler")
    await deployment.executor("w", 2)
    workflow_id = await client.submit_workflow(
        {
            "name": "results",
            "tasks": [
                {"name": "three", "handler": "tests.handlers:emit", "args": {"value": 3}},
                command("four", ["sh", "-c", 'echo 4 > "$SKED_OUTPUT"']),
                command("broken", ["false"]),
                command("never", ["true"], "broken"),  # skipped: on_success cannot hold
                {
                    "name": "sum",
                    "handler": "tests.handlers:total",
                    "args": {"base": 100},
                    "needs": [
                        "three",
                        "four",
                        {"task": "broken", "condition": "always"},
                        {"task": "never", "condition": "always"},
                    ],
                },
                command("report", ["sh", "-c", 'cp "$SKED_INPUTS" "$SKED_OUTPUT"'], "sum", "three"),
            ],
        }
    )
    view = await client.wait_workflow(workflow_id, timeout=60)
    tasks = {t.wf_task: t for t in view.tasks}
    assert tasks["never"].status is State.SKIPPED
    assert tasks["sum"].inputs == {"three": 3, "four": 4}
    assert tasks["sum"].result == 107
    assert tasks["report"].result == {"exit_code": 0, "output": {"sum": 107, "three": 3}}
    await check_all_histories(pool)


async def test_tasks_waiting_for_a_resource_do_not_hold_back_others(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool
) -> None:
    """Three high-priority tasks share a lock of capacity 1 on a two-slot node: while one
    holds it, the others wait aside, and the free slot runs unrelated low-priority tasks —
    they do not wait for the lock's holders to finish."""
    await deployment.start("scheduler")
    await deployment.executor("w", 2)
    workflow_id = await client.submit_workflow(
        {
            "name": "lock",
            "resources": {"lock": 1},
            "tasks": [
                command(f"locked-{i}", ["sleep", "2"], uses=["lock"], priority=10) for i in range(3)
            ],
        }
    )

    async def holding() -> Any:
        try:
            view = await client.workflow(workflow_id)
        except NotFound:
            return None
        return any(t.status is State.RUNNING for t in view.tasks)

    await eventually(holding, timeout=60, what="the lock held")
    others = await client.submit_many(
        [{"name": f"other-{i}", "job": {"kind": "command", "argv": ["true"]}} for i in range(4)]
    )
    done = await client.wait_all(others, timeout=60)
    view = await client.wait_workflow(workflow_id, timeout=60)
    assert all(t.status is State.SUCCESS for t in [*done.values(), *view.tasks])
    first_release = min(t.finished_at for t in view.tasks)  # type: ignore[type-var]
    late = [t.name for t in done.values() if t.finished_at > first_release]  # type: ignore[operator]
    assert not late, f"{late} waited for the lock's first holder to finish"
    await check_all_histories(pool)
