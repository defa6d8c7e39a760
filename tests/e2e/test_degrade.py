"""Degrade modes end to end: two schedulers obey one mode; partial dispatches only urgent
tasks, full dispatches none, running work goes on, lifting the mode lets the rest run."""

from __future__ import annotations

import asyncio
import json

from shared.client import SkedClient
from shared.degrade import Mode
from shared.errors import NotFound
from shared.fsm import State
from tests.e2e.conftest import Deployment
from tests.helpers import eventually


def command(name: str, line: str, priority: int = 0) -> dict[str, object]:
    return {
        "name": name,
        "priority": priority,
        "job": {"kind": "command", "argv": ["sh", "-c", line]},
    }


async def states(client: SkedClient, ids: list[object]) -> list[State | None]:
    out: list[State | None] = []
    for task_id in ids:
        try:
            out.append((await client.get(task_id)).status)  # type: ignore[arg-type]
        except NotFound:
            out.append(None)
    return out


async def test_partial_and_full_gate_dispatch_and_leave_running_work_alone(
    deployment: Deployment, client: SkedClient
) -> None:
    await deployment.start("scheduler")
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("n1", 4)
    long = await client.submit(command("long", "sleep 4"))

    async def long_running() -> bool:
        return (await states(client, [long]))[0] is State.RUNNING

    await eventually(long_running, what="the long task running")

    partial = await client.degrade(Mode.PARTIAL, "test: only urgent work", "tester", 120)
    assert partial.mode is Mode.PARTIAL
    low = await client.submit_many([command(f"low{i}", "true") for i in range(3)])
    high = await client.submit_many([command(f"high{i}", "true", priority=200) for i in range(2)])
    done = await client.wait_all(high, timeout=30)
    assert all(t.status is State.SUCCESS for t in done.values())
    await asyncio.sleep(1.0)  # a low task would have been dispatched by now
    assert await states(client, low) == [State.READY] * 3

    await client.degrade(Mode.FULL, "test: nothing new", "tester", 120)
    urgent = await client.submit(command("urgent", "true", priority=900))
    await asyncio.sleep(1.5)
    assert await states(client, [urgent]) == [State.READY]
    # running work is never touched
    assert (await client.wait(long, timeout=30)).status is State.SUCCESS

    status = await client.degrade_status()
    assert (status.mode, status.set_by, status.automatic) == (Mode.FULL, "tester", False)
    lifted = await client.degrade(Mode.NORMAL, "lifted", "tester")
    assert lifted.effective() is Mode.NORMAL
    rest = await client.wait_all([*low, urgent], timeout=30)
    assert all(t.status is State.SUCCESS for t in rest.values())


async def test_sked_degrade_commands(deployment: Deployment, service_env: dict[str, str]) -> None:
    from tests.helpers import SKED

    async def sked(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            SKED,
            *args,
            env=service_env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        code = proc.returncode or 0
        return code, (out + err).decode() if code else out.decode()  # logs go to stderr

    code, out = await sked(
        "degrade", "partial", "--for", "60", "--reason", "GPU work", "--by", "ann"
    )
    assert code == 0, out
    assert out.startswith("partial since")
    code, out = await sked("degrade", "status", "--json")
    shown = json.loads(out)
    assert (shown["mode"], shown["effective"], shown["set_by"]) == ("partial", "partial", "ann")
    assert shown["reason"] == "GPU work"
    code, out = await sked("degrade", "full")
    assert code != 0
    assert "--reason is required" in out
    code, out = await sked("degrade", "off")
    assert code == 0, out
    assert out.startswith("normal")
