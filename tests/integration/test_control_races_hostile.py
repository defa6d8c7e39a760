"""Operator controls racing the live pipeline (the sixteenth session's probe). Concurrent
floods of controls through the HTTP API, pause/resume flapping during a burst and
cancel_workflow at five points of a live run held; the case here failed, and its docstring
says what happened and what happens now."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from shared import control
from shared.fsm import State
from shared.settings import Settings
from tests.helpers import spec
from tests.integration.pipeline import services


@pytest.mark.parametrize("action", ["cancel", "pause"])
async def test_a_control_acknowledged_between_claim_and_start_starts_no_process(
    settings: Settings, tmp_path: Path, action: str
) -> None:
    """An operator cancels (or pauses) a task in the window between its executor's claim
    (Scheduling -> Running, committed) and the executor reading the claim's reply. The
    control's CAS wins (Running -> Canceled), the operator is answered 200 "Canceled", and its
    NOTIFY on the taken-away channel reaches the executor while the claim's reply is still in
    flight. `Watcher.on_task_notify` -> `Node.suspect` keeps only ids already in `node.active`
    (services/executor/node.py:168), and the attempt is not there yet (`Starter.settle` puts
    it there via `_begin`), so the notice is dropped; `settle` then `_begin`s the attempt and
    `_outcome` launches the process without looking at the task again. The command starts
    (and here runs to completion) after the cancel was acknowledged; only the next lease
    renewal (up to SKED_NODE_HEARTBEAT_S later) would notice. That was so until the sixteenth
    session: a canceled job's side effects happened anyway (a deploy, a payment, a mail), and
    a paused one ran while the operator believed it held.

    Now the node notes the tasks taken-away notices name while a claim is in flight
    (`Node.taken_early`); `settle` reads those of the claim's won attempts again and starts
    none that is no longer Running in that attempt (its halted outcome loses its CAS and
    gives the lease back, as a stop's), and one named while that read is on its way is
    stopped by the watch loop once begun."""
    marker = tmp_path / "ran"
    acked: list[Any] = []
    acked_at: list[float] = []
    async with asyncio.timeout(50):
        async with services(settings, tmp_path / "work", slots=1) as run:
            tasks = run.executor.node.store.tasks
            real = tasks.transition_many

            async def claim_then_control(moves: Any) -> Any:
                won = await real(moves)
                if any(m.target is State.RUNNING for m in moves) and won.ids and not acked:
                    # the operator's control commits and is answered right after the claim's
                    # COMMIT, while the claim's reply is still on its way to the executor
                    (task_id,) = won.ids
                    if action == "cancel":
                        done = await control.cancel(run.store, None, task_id, "stop", "ann")
                    else:
                        done = await control.pause(run.store, task_id, "hold", "ann")
                    acked.append(done)
                    acked_at.append(time.time())
                    await asyncio.sleep(0.5)  # its NOTIFY reaches the executor meanwhile
                return won

            tasks.transition_many = claim_then_control  # type: ignore[method-assign]
            argv = ["sh", "-c", f"date +%s.%N > {marker}; sleep 0.2; echo done >> {marker}"]
            task_id = await run.client.submit(
                spec(f"{action}-window", job={"kind": "command", "argv": argv})
            )
            for _ in range(100):
                if acked:
                    break
                await asyncio.sleep(0.1)
            assert acked, "the control never ran"
            await asyncio.sleep(3)
            now = await run.store.tasks.get(task_id)
    assert acked[0].status in (State.CANCELED, State.PAUSED)
    started = marker.read_text().split() if marker.exists() else []
    assert not started, (
        f"task {task_id}: {action} acknowledged ({acked[0].status.label}) before its process "
        f"started, yet the process started {float(started[0]) - acked_at[0]:.2f} s after the "
        f"acknowledgement and wrote {started[1:]}; the task is {now.status.label}"
    )
