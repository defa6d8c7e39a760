"""The executor's gated start loop (services/executor/start.py) driven alone, on a stand-in node:
the orders of events between the loop, the finisher's claims and the inbox that an end-to-end
run meets only by chance."""

from __future__ import annotations

import asyncio
import contextlib
import time
import types
from uuid import UUID

from services.executor.start import Starter


async def test_gated_start_loop_survives_a_claim_that_empties_the_backlog() -> None:
    """Seen in an end-to-end run (two schedulers, a review round): an executor exited with
    `IndexError: deque index out of range` in `Starter._run_gated` (`held[0]`), its running
    attempt left to its lease to be found Lost. On a Starter alone: a gated node with its one
    slot busy, the start loop waiting on the inbox with nothing held; a dispatch arrives and,
    before the loop runs, the finisher's `claimable` gathers it into the backlog (which, the
    backlog having been empty, also puts an empty wake-up batch in the inbox) and takes it to
    claim. The loop woke on the empty batch with nothing held and no free slot (it is being
    claimed), and read held[0]. Now it waits again. (This session's own code: the wake-up
    came with the outcome statement's claims taking the inbox.)"""

    node = types.SimpleNamespace(
        gated=True,
        stopping=asyncio.Event(),
        inbox=asyncio.Queue(),
        slot_freed=asyncio.Event(),
        settings=types.SimpleNamespace(slots=1),
        running=1,
        backlog=types.SimpleNamespace(hold_s=5.0),
        serves={"a"},
        active={},
        ended={},
    )
    dispatch = types.SimpleNamespace(task_id=UUID(int=1), attempt=1, node="a")
    item = types.SimpleNamespace(
        dispatch=dispatch, received_at=time.monotonic(), settled=False, line=(0, 0.0)
    )
    starter = Starter(node)  # type: ignore[arg-type]
    loop = asyncio.create_task(starter._run_gated())
    await asyncio.sleep(0.01)  # waiting on the inbox, nothing held
    node.inbox.put_nowait([item])
    claims = await starter.claimable(1, [])  # the finisher, an outcome about to free the slot
    await asyncio.sleep(0.05)
    crashed = loop.exception() if loop.done() else None
    node.stopping.set()
    node.inbox.put_nowait(None)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(loop, 2)
    assert len(claims) == 1
    assert crashed is None, f"the start loop died: {crashed!r}"
