"""A review of the sixteenth session's own code: handler workers that exit right after the
reply that retires them (worker.py, workers.py), and cancels or pauses that land while a claim
is in flight (node.taken_early, start.py). Each case failed on that code (the docstrings say
what happened); each test shows it no longer does. Held up: a forged retire reply (the real
reply then breaches, and the jobs behind are lost, never returned), a child left SIGSTOPped,
a retry's notice for attempt N-1 during attempt N's claim, overlapping claims."""

from __future__ import annotations

import asyncio
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from services.executor.backends import Launch
from services.executor.backends.local import LocalBackend
from shared import control
from shared.fsm import State
from shared.models import HandlerJob
from shared.settings import Settings
from tests.helpers import spec
from tests.integration.pipeline import services
from tests.integration.test_worker_state_hostile import one, run  # noqa: F401 (fixture)

HERE = "tests.integration.test_review7_hostile"


# --- handlers (run in the workers) -------------------------------------------------------------


def noop() -> str:
    return "ok"


def my_pid() -> int:
    return os.getpid()


_flusher: threading.Thread | None = None


def _flush_forever() -> None:
    while True:
        time.sleep(0.05)


def lower_nofile_for_good_with_a_flusher(n: int) -> int:
    """A handler module with a background (non-daemon) flusher thread, as a metrics or log
    shipper's client starts one; this job also lowers a limit the worker cannot raise back (as
    in test_worker_state_hostile: a setrlimit that refuses stands for the missing privilege,
    the tests running as root). Any other retire (a leftover that would not end, descriptors
    past fd_mark) does the same."""
    global _flusher
    if _flusher is None:
        _flusher = threading.Thread(target=_flush_forever, name="flusher")
        _flusher.start()
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    def refuse(*_: Any) -> None:
        raise PermissionError("not permitted")

    resource.setrlimit = refuse  # type: ignore[assignment]
    return os.getpid()


def handler(name: str, args: Any = None, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}", args=args), timeout_s)


# --- findings ----------------------------------------------------------------------------------


async def test_a_job_queued_behind_a_retiring_worker_whose_exit_would_block_ends(
    one: LocalBackend,  # noqa: F811
) -> None:
    """The node's handler jobs run short, so task B (no timeout) is queued behind task A at A's
    worker (pool.busy_worker). A's job is one the worker cannot put back after (here a limit
    lowered for good): its reply carries "retire", and since 316105f the worker leaves its
    serve loop right after writing it and `main()` returns — into interpreter finalization,
    which joins every non-daemon thread (threading._shutdown) and runs atexit hooks. The
    handler's module has a background non-daemon thread (a metrics/log flusher, a
    ThreadPoolExecutor with a long-running item): the worker never exits. The executor took
    A's answer; B now heads the worker's pending jobs, but the worker will neither run it (its
    loop ended) nor exit (so `Worker._end` never settles it "returned"), no rescue is armed for
    a single pending job, and the pool kills a retired worker only once its last holder (B)
    releases it (WorkerPool.release). B has no outcome, ever (with a timeout: not until it
    fires, then it is rerun — a spent timeout for a job that never started), and the slot is
    gone with it. Guarantee broken: every task is driven to a terminal state. Before the
    change B ran in the (retired) worker. Now the worker ends with os._exit right after the
    retire reply, and the executor kills a worker whose retire reply it read while jobs wait
    there: B comes back "returned" and runs in a fresh worker."""
    pool = one._pool
    # the node's recent jobs ran short (the worker's start rolled out of the window): a job
    # may wait behind another (pool.short())
    for _ in range(40):
        assert (await run(one, handler("noop"))).ok
    assert pool.short()
    a_task = asyncio.ensure_future(one.run(handler("lower_nofile_for_good_with_a_flusher", [512])))
    b_task = asyncio.ensure_future(one.run(handler("my_pid")))
    try:
        a = await asyncio.wait_for(asyncio.shield(a_task), 20)
        assert a.ok, a.error
        done, _ = await asyncio.wait({b_task}, timeout=15)
        stuck = Path(f"/proc/{a.result}").exists()
        assert done, (
            "task B (no timeout) had no outcome 15 s after the job ahead of it ended; "
            f"A's retired worker {a.result} {'is still alive' if stuck else 'is gone'}"
        )
        b = b_task.result()
        assert b.ok, b.error
    finally:
        for t in (a_task, b_task):
            t.cancel()
        await asyncio.gather(a_task, b_task, return_exceptions=True)


@pytest.mark.parametrize("action", ["cancel", "pause"])
async def test_a_control_during_the_finishers_claim_starts_no_process(
    settings: Settings, tmp_path: Path, action: str
) -> None:
    """87b717d made a cancel (or pause) whose NOTIFY lands while a claim statement is in flight
    start no process: `Starter._claim` counts itself in `node.claims_open`, `Node.suspect`
    records the notice in `node.taken_early` only while that count is above 0, and `settle`
    re-reads those tasks (`Node.taken_early_from`). But a held dispatch (a node with a
    backlog, SKED_PREFETCH) is claimed by the *finisher*, in the same statement that writes the
    outcome freeing its slot (`Finisher._end_and_claim` -> `_ended_and_claimed` ->
    `Starter.settle`), and that path never touches `claims_open`. A cancel acknowledged right
    after that statement's COMMIT sends its NOTIFY while the reply is on its way: claims_open
    is 0, so `suspect` drops it (the task is not in `node.active` yet), `taken_early` stays
    empty, `settle` re-reads nothing and begins the attempt: the command runs (here to the
    end) after the operator was told "Canceled"/"Paused", until a lease renewal notices. The
    same window the commit closed for the starter's claims stays open for the finisher's —
    the common path on a busy node with a backlog. Guarantee broken: a task canceled or
    paused does not run (side effects of a canceled deploy/payment). Now every statement
    whose won attempts are begun after its reply (the starter's claim, the finisher's
    outcomes with claims, an adoption) runs inside `Node.claim_window`."""
    marker = tmp_path / "ran"
    acked: list[Any] = []
    combined: list[bool] = []
    async with asyncio.timeout(55):
        async with services(settings, tmp_path / "work", slots=1, prefetch=4) as run_:
            tasks = run_.executor.node.store.tasks
            real = tasks.transition_many
            target: list[Any] = []

            async def claim_then_control(moves: Any) -> Any:
                won = await real(moves)
                claims = [m for m in moves if m.target is State.RUNNING]
                ends = [m for m in moves if m.target is not State.RUNNING]
                if claims and ends and not acked and target:
                    combined.append(True)  # the finisher's end-and-claim statement
                    for m in claims:
                        if m.task_id == target[0] and m.task_id in won.ids:
                            # the control commits and is answered right after this COMMIT,
                            # while the statement's reply is on its way to the executor
                            tid = m.task_id
                            if action == "cancel":
                                done = await control.cancel(run_.store, None, tid, "stop", "ann")
                            else:
                                done = await control.pause(run_.store, tid, "hold", "ann")
                            acked.append(done)
                            await asyncio.sleep(0.5)  # its NOTIFY reaches the executor
                return won

            tasks.transition_many = claim_then_control  # type: ignore[method-assign]
            await run_.client.submit(
                spec(f"{action}-first", job={"kind": "command", "argv": ["sleep", "1.5"]})
            )
            await asyncio.sleep(0.3)
            argv = ["sh", "-c", f"date +%s.%N > {marker}; sleep 0.2; echo done >> {marker}"]
            second = spec(f"{action}-second", job={"kind": "command", "argv": argv})
            target.append(await run_.client.submit(second))
            for _ in range(150):
                if acked:
                    break
                await asyncio.sleep(0.1)
            assert combined, "the finisher never claimed with an outcome"
            assert acked, "the control never ran"
            await asyncio.sleep(3)
            now = await run_.store.tasks.get(target[0])
    assert acked[0].status in (State.CANCELED, State.PAUSED)
    assert not marker.exists(), (
        f"{action} acknowledged ({acked[0].status.label}) before its process started, yet "
        f"the process ran and wrote {marker.read_text().split()[1:]}; the task is "
        f"{now.status.label}"
    )
