"""A review of the sixteenth session's claim window (87b717d, fac314c) and C environment mark
(7ad8c43): review 9. Each case failed on that code; the docstrings say what happened, and
what happens now. Held up: the taken=True path with the reply read (cancel; pause then
resume runs once), a notice naming every task during a claim, SIGTERM during the window, and
the C environment shrunk then grown, or a job's own variable unset below os.environ."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from shared import control
from shared.fsm import State
from shared.settings import Settings
from tests.e2e.checks import check_history, histories
from tests.helpers import spec
from tests.integration.pipeline import Services, services


async def _events(run: Services, task_id: UUID) -> list[Any]:
    return (await histories(run.store.pool))[task_id]


async def _lease(run: Services, task_id: UUID) -> Any:
    return await run.store.pool.fetchrow(
        "SELECT status, attempt, lease_owner, lease_attempt, lease_until FROM tasks WHERE id=$1",
        task_id,
    )


async def _late(run: Services, task_id: UUID) -> list[Any]:
    return await run.store.pool.fetch(
        "SELECT attempt, ok, error, note FROM late_results WHERE task_id=$1", task_id
    )


def _control_during_claim(
    run: Services, action: str, acked: list[Any], *, lose_reply: bool = False, extra: Any = None
) -> None:
    """Wrap the executor's transition_many: right after a claim's COMMIT, the operator's
    control commits (and, `lose_reply`, the claim's reply is lost: a transient error)."""
    tasks = run.executor.node.store.tasks
    real = tasks.transition_many

    async def claim_then_control(moves: Any) -> Any:
        won = await real(moves)
        if any(m.target is State.RUNNING for m in moves) and won.ids and not acked:
            (task_id,) = [m.task_id for m in moves if m.target is State.RUNNING]
            if action == "cancel":
                done = await control.cancel(run.store, None, task_id, "stop", "ann")
            else:
                done = await control.pause(run.store, task_id, "hold", "ann")
            acked.append(done)
            if extra is not None:
                extra()
            await asyncio.sleep(0.5)  # its NOTIFY reaches the executor meanwhile
            if lose_reply:
                raise ConnectionResetError("connection lost after COMMIT (probe)")
        return won

    tasks.transition_many = claim_then_control  # type: ignore[method-assign]


async def _until(pred: Any, bound: float, step: float = 0.1) -> bool:
    end = time.monotonic() + bound
    while time.monotonic() < end:
        if await pred():
            return True
        await asyncio.sleep(step)
    return bool(await pred())


@pytest.mark.parametrize("action", ["cancel", "pause"])
async def test_a_control_during_a_claim_retried_after_a_lost_reply_gives_the_lease_back(
    settings: Settings, tmp_path: Path, action: str
) -> None:
    """A claim (Scheduling -> Running, taking this incarnation's lease) COMMITs; the operator
    cancels or pauses the task; the claim's reply is lost (ConnectionResetError after the
    COMMIT, what pg_terminate_backend or a Postgres restart gives). `retrying("start")` sends
    the claim again: it loses its CAS, `Starter.settle`'s `tries > 1` branch reads the task,
    sees it is not Running and treats the dispatch as stale. No process starts (held), but
    the attempt's lease stays with this incarnation until it lapses (heartbeat_timeout_s, 40 s
    here): no halted outcome, no late result, no release. Since a lease holds its node's slot
    and fences a resumed task, the next task on this 1-slot node (cancel) or the resumed task
    itself (pause) does not run for the lease's length; with the reply read, the taken=True
    path gives the lease back at once. Now a task whose lease this incarnation holds for the
    dispatch's attempt but that is no longer Running was won and taken away: begun with
    taken=True (its halted outcome recorded late, its lease released at once)."""
    marker = tmp_path / "ran"
    acked: list[Any] = []
    async with asyncio.timeout(58):
        async with services(settings, tmp_path / "work", slots=1) as run:
            _control_during_claim(run, action, acked, lose_reply=True)
            argv = ["sh", "-c", f"echo x >> {marker}"]
            task_id = await run.client.submit(
                spec(f"{action}-x", job={"kind": "command", "argv": argv}, heartbeat_timeout_s=40)
            )
            assert await _until(lambda: _async(bool(acked)), 10)
            await asyncio.sleep(1.5)  # the retried claim loses; its dispatch is dropped
            assert not marker.exists(), marker.read_text()  # (held: no process)
            row = await _lease(run, task_id)
            t0 = time.monotonic()
            if action == "pause":
                await control.resume(run.store, run.scheduler.queue, task_id, "ann")
                waited = task_id
            else:
                waited = await run.client.submit(spec("next", heartbeat_timeout_s=40))
            try:
                done = await run.client.wait(waited, timeout=12)
            except Exception as exc:
                done = exc
            took = time.monotonic() - t0
            assert getattr(done, "status", None) is State.SUCCESS, (
                f"{action} committed between the claim's COMMIT and its (lost) reply: the "
                f"retried claim dropped the dispatch but never gave back the attempt's lease "
                f"({dict(row)}, late results: {[dict(r) for r in await _late(run, task_id)]}); "
                f"{'the resumed task' if action == 'pause' else 'the next task on the 1-slot node'}"
                f" had not run {took:.1f} s later: {done!r}"
            )
            check_history(task_id, await _events(run, task_id))


async def _async(v: Any) -> Any:
    return v


async def test_a_pause_during_the_finishers_claim_retried_after_a_lost_reply_fences_no_resume(
    settings: Settings, tmp_path: Path
) -> None:
    """The finisher's end-and-claim statement (a node with a backlog) COMMITs, the operator
    pauses the claimed task, and the statement's reply is lost (ConnectionResetError, as a
    pg_terminate_backend or a Postgres restart gives). `retrying("finish")` sends it again:
    the claim loses its CAS, `Starter.settle(tries=2)` reads the task, finds it Paused (not
    Running) and drops the dispatch as stale. Nobody gives the attempt's lease back (no
    halted outcome, no late result, no `leases.release`): on resume the task is fenced
    (sked:parked:fenced) until the lease lapses (heartbeat_timeout_s, here 40 s), so it does
    not run within 12 s. Now it is begun with taken=True, as in the reply-read case (the
    finisher's statement goes through the same `settle`)."""
    action = "pause"
    marker = tmp_path / "ran"
    acked: list[Any] = []
    async with asyncio.timeout(58):
        async with services(settings, tmp_path / "work", slots=1, prefetch=4) as run:
            tasks = run.executor.node.store.tasks
            real = tasks.transition_many
            target: list[Any] = []

            async def end_and_claim_then_control(moves: Any) -> Any:
                won = await real(moves)
                claims = [m for m in moves if m.target is State.RUNNING]
                ends = [m for m in moves if m.target is not State.RUNNING]
                if claims and ends and not acked and target:
                    for m in claims:
                        if m.task_id == target[0] and m.task_id in won.ids:
                            tid = m.task_id
                            if action == "cancel":
                                done = await control.cancel(run.store, None, tid, "stop", "ann")
                            else:
                                done = await control.pause(run.store, tid, "hold", "ann")
                            acked.append(done)
                            await asyncio.sleep(0.5)
                            raise ConnectionResetError("reply lost after COMMIT (probe)")
                return won

            tasks.transition_many = end_and_claim_then_control  # type: ignore[method-assign]
            await run.client.submit(
                spec("first", job={"kind": "command", "argv": ["sleep", "1.5"]})
            )
            await asyncio.sleep(0.3)
            argv = ["sh", "-c", f"echo x >> {marker}"]
            target.append(
                await run.client.submit(
                    spec("second", job={"kind": "command", "argv": argv}, heartbeat_timeout_s=40)
                )
            )
            task_id = target[0]
            assert await _until(lambda: _async(bool(acked)), 15), "no end-and-claim"
            await asyncio.sleep(1.5)
            assert not marker.exists(), marker.read_text()
            row = await _lease(run, task_id)
            t0 = time.monotonic()
            if action == "pause":
                await control.resume(run.store, run.scheduler.queue, task_id, "ann")
                waited = task_id
            else:
                waited = await run.client.submit(spec("next", heartbeat_timeout_s=40))
            try:
                done = await run.client.wait(waited, timeout=12)
            except Exception as exc:
                done = exc
            took = time.monotonic() - t0
            assert getattr(done, "status", None) is State.SUCCESS, (
                f"finisher path, {action}: lease kept {dict(row)}; late="
                f"{[dict(r) for r in await _late(run, task_id)]}; not run {took:.1f}s: {done!r}"
            )
            check_history(task_id, await _events(run, task_id))


# --- the C environment's mark (jobstate.py) --------------------------------------------------

import os  # noqa: E402
import subprocess  # noqa: E402
from uuid import uuid4  # noqa: E402

from services.executor.backends import Launch  # noqa: E402
from services.executor.backends.local import LocalBackend  # noqa: E402
from shared.models import HandlerJob  # noqa: E402
from tests.integration.test_review10_hostile import append_raw  # noqa: E402
from tests.integration.test_worker_state_hostile import one, run  # noqa: E402,F401

HERE = "tests.integration.test_review9_hostile"


def h(name: str, args: Any = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}", args=args), None)


def seen(names: list[str]) -> dict[str, Any]:
    """What this job's os.environ and a subprocess (env=None) have for `names`."""
    script = "; ".join(f'echo "{n}=${{{n}-<unset>}}"' for n in names)
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    child = dict(line.split("=", 1) for line in out.splitlines())
    return {
        "python": {n: os.environ.get(n, "<unset>") for n in names},
        "child": child,
        "pid": os.getpid(),
    }


def append_duplicate(name: str, value: str) -> int:
    """Append a second NAME=value entry to the C environment's array (ctypes, malloc'd)."""
    return append_raw(f"{name}={value}")


def shrink_then_set(names: list[str], name: str, value: str) -> int:
    for n in names:
        os.unsetenv(n)
    os.putenv(name, value)
    return os.getpid()


def unset_below(name: str) -> int:
    os.unsetenv(name)
    return os.getpid()


async def _seen_next(one: LocalBackend, names: list[str]) -> dict[str, Any]:  # noqa: F811
    o = await run(one, h("seen", [names]))
    assert o.ok, o.error
    return o.result


async def test_a_duplicate_entry_a_job_adds_to_the_c_environment_reaches_no_later_job(
    one: LocalBackend,  # noqa: F811
) -> None:
    """A job appends a second HOME=/probe-evil to the C environment's array (ctypes: a new
    malloc'd array assigned to `environ`, as a C extension may build one). The worker notices
    the array moved (`mark_env`), but `_c_env_back` reads it through `_c_environ`, which keeps
    only the FIRST entry of a name (`found.setdefault`): HOME matches os.environ, so nothing is
    put back and the duplicate stays. A later job's subprocess (env=None) inherits both
    entries, and sh (dash, bash) takes the LAST: the next job's child sees HOME=/probe-evil
    while its os.environ says /root. Now `_c_environ` marks a name found twice, and it is
    unset (glibc's unsetenv removes every entry) and put back from os.environ."""
    before = await _seen_next(one, ["PATH", "HOME"])
    o = await run(one, h("append_duplicate", ["HOME", "/probe-evil"]))
    assert o.ok, o.error
    after = await _seen_next(one, ["PATH", "HOME"])
    assert after["pid"] == o.result == before["pid"]
    assert after["child"] == after["python"] == before["python"], (before, after)
