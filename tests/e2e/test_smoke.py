"""The smallest whole pipeline: submit one command and one handler, both succeed."""

from __future__ import annotations

from shared.client import SkedClient
from shared.fsm import State
from tests.e2e.conftest import Deployment


async def test_one_command_and_one_handler(deployment: Deployment, client: SkedClient) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("n1", 2)
    cmd = await client.submit(
        {"name": "echo", "job": {"kind": "command", "argv": ["sh", "-c", "echo hi $SKED_ATTEMPT"]}}
    )
    handler = await client.submit(
        {
            "name": "add",
            "job": {"kind": "handler", "handler": "tests.e2e.jobs:add", "args": {"a": 2, "b": 3}},
        }
    )
    done = await client.wait_all([cmd, handler], timeout=30)
    assert done[cmd].status is State.SUCCESS, done[cmd]
    assert "hi 1" in (done[cmd].log_tail or "")
    assert done[handler].status is State.SUCCESS, done[handler]
    assert done[handler].result == 5
    history = [(e.from_status, e.to_status) for e in await client.history(cmd)]
    assert [t for _, t in history] == [
        State.CREATED,
        State.PENDING,
        State.READY,
        State.SCHEDULING,
        State.RUNNING,
        State.SUCCESS,
    ]
