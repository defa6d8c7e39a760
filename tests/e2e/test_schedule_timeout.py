"""The schedule-to-start timeout end to end: a task no node can take ends Failed about its
timeout after it became Ready — from the SDK, in a workflow, and from `sked submit` — while a
normal task of the same run succeeds."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import asyncpg

from shared.client import SkedClient
from shared.fsm import State
from shared.models import Event
from tests.e2e.checks import check_all_histories
from tests.e2e.conftest import Deployment
from tests.helpers import SKED

NOWHERE = {"zone": "mars"}  # no node has this label
# A 2 s schedule timeout fires "about 2 s" after Ready on Postgres's clock: never before
# (EARLIEST_S allows the spread of the event stamps), and well before the 5 s reconcile
# backstop plus a loaded machine's delay (LATEST_S).
EARLIEST_S, LATEST_S = 1.5, 8.0


def command(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "job": {"kind": "command", "argv": ["sh", "-c", "echo ok"]}, **kw}


def waited_s(history: list[Event]) -> float:
    """From entering Ready to ending Failed, by the events' Postgres stamps."""
    ready = next(e.at for e in history if e.to_status is State.READY)
    failed = next(e.at for e in history if e.to_status is State.FAILED)
    return (failed - ready).total_seconds()


async def test_a_task_no_node_can_take_fails_after_its_schedule_timeout(
    deployment: Deployment, client: SkedClient, pool: asyncpg.Pool, service_env: dict[str, str]
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("n1", 2)
    stuck = await client.submit(
        command("stuck", schedule_timeout_s=2, selector=NOWHERE, max_retries=3)
    )
    normal = await client.submit(command("normal", schedule_timeout_s=30))
    workflow_id = await client.submit_workflow(
        {
            "name": "wf",
            "tasks": [
                {
                    "name": "stuck",
                    "command": ["true"],
                    "schedule_timeout_s": 2,
                    "selector": NOWHERE,
                },
                {
                    "name": "cleanup",
                    "command": ["true"],
                    "needs": [{"task": "stuck", "condition": "on_failure"}],
                },
                {"name": "report", "command": ["true"], "needs": ["stuck"]},
            ],
        }
    )

    done = await client.wait_all([stuck, normal], timeout=60)
    assert done[normal].status is State.SUCCESS, done[normal]
    failed = done[stuck]
    reason = "not started within 2 s (schedule_timeout_s)"
    assert (failed.status, failed.status_reason, failed.error) == (State.FAILED, reason, reason)
    assert (failed.retry_count, failed.attempt) == (3, 0)  # final, and no attempt ever made
    history = await client.history(stuck)
    assert [e.to_status for e in history][-2:] == [State.READY, State.FAILED]
    waited = waited_s(history)
    assert EARLIEST_S <= waited <= LATEST_S, f"failed {waited} s after Ready: {history}"

    view = await client.wait_workflow(workflow_id, timeout=60)
    states = {t.wf_task: t for t in view.tasks}
    assert states["stuck"].status is State.FAILED
    assert states["stuck"].status_reason == reason
    waited = waited_s(await client.history(states["stuck"].id))
    assert EARLIEST_S <= waited <= LATEST_S, f"the workflow task failed {waited} s after Ready"
    assert states["cleanup"].status is State.SUCCESS  # on_failure: runs
    assert states["report"].status is State.SKIPPED  # on_success: can no longer hold
    assert view.status() == "failed"

    argv = ["submit", "--command", "true", "--selector", "zone=mars", "--schedule-timeout", "1"]
    cli = await asyncio.to_thread(
        subprocess.run,
        [SKED, *argv, "--wait", "--wait-timeout", "60"],
        env=service_env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert cli.returncode == 1, cli
    assert "Failed: not started within 1 s (schedule_timeout_s)" in cli.stdout, cli

    await check_all_histories(pool)
