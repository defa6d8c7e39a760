"""The local backend's process supervision (the warden, its shims, the handler workers) against
a hostile task. Each case was found by an adversarial review, where it failed: the docstrings
say what happened; each test shows it no longer does.

Handlers the tests run are defined here and run in the handler workers as
`tests.integration.test_warden_hostile:<name>`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from uuid import uuid4

import asyncpg
import pytest

from services.executor.backends import Launch
from services.executor.backends.local import LocalBackend
from shared import fsm
from shared.fsm import State
from shared.models import HandlerJob
from shared.settings import Settings
from shared.store import Store
from tests.integration.test_backend_local import read_pid, until
from tests.integration.test_executor_hostile import command, run
from tests.integration.test_executor_lifecycle_hostile import running_executor, scheduled, sh

HERE = "tests.integration.test_warden_hostile"


# --- handlers (run in the workers) -------------------------------------------------------------


def fail_leaving_a_child(pidfile: str, ticks: str) -> None:
    """Start a process of the attempt's own (as any handler may: a helper, a download), then
    fail: the attempt is over, and a retry will run."""
    script = 'while :; do echo x >> "$0"; sleep 0.05; done'
    child = subprocess.Popen(["sh", "-c", script, ticks])
    Path(pidfile).write_text(str(child.pid))
    deadline = time.monotonic() + 10  # working before the job ends (the worker kills it then)
    while not (os.path.exists(ticks) and os.path.getsize(ticks)) and time.monotonic() < deadline:
        time.sleep(0.01)
    raise RuntimeError("failed: retry me")


# --- helpers -----------------------------------------------------------------------------------


def handler(name: str, args: Any = None, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}", args=args), timeout_s)


def state(pid: int) -> str | None:
    """A process's state letter; None once it is gone (a zombie counts as gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    found = raw[raw.rindex(b")") + 2 :].split()[0].decode()
    return None if found in ("Z", "X") else found


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


async def grows(path: Path, within: float = 0.6) -> bool:
    before = size(path)
    await asyncio.sleep(within)
    return size(path) > before


def kill_quietly(pid: int | None, sig: int = signal.SIGKILL) -> None:
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    b = LocalBackend(2, tmp_path / "state", warm_workers=0)
    await b.start()
    yield b
    warden = b._warden._proc
    if warden is not None:
        kill_quietly(warden.pid, signal.SIGCONT)  # a test may leave it stopped
    async with asyncio.timeout(40):
        await b.close()


# --- findings ----------------------------------------------------------------------------------


async def test_a_task_that_stops_its_shim_is_never_frozen_when_its_lease_lapses(
    backend: LocalBackend, tmp_path: Path
) -> None:
    """The shim is the lease's only enforcer while the executor is frozen or cut off from
    Postgres ("the watchdog freezes the attempt on its own"): the heartbeat-monitor, told
    "running, but its lease lapsed", gives a grace and then declares the attempt Lost and
    retries it elsewhere, trusting the watchdog to have stopped it. A task SIGSTOPped its
    shim (its parent) at once: the shim never woke at the lease's end, the tree ran on past
    its lease with no limit (not even freeze_max_s), and the backend did not even know. A
    retry elsewhere would run beside it. Now the executor watches each lease's end too
    (`Proc._lapsed`): a shim that has not said it froze the tree and is found stopped has the
    tree killed from the executor."""
    ticks = tmp_path / "ticks"
    launch = replace(
        command(f"kill -STOP $PPID; while :; do echo x >> {ticks}; sleep 0.05; done"),
        lease_s=0.5,
    )
    key = (launch.task_id, launch.attempt)
    job = asyncio.create_task(backend.run(launch))
    try:
        await until(lambda: size(ticks) > 0, "the task to start")
        await asyncio.sleep(1.5)  # the lease lapsed a second ago: no renewal came
        still_running = await grows(ticks)
        frozen = backend.frozen(key)
    finally:
        await backend.stop_task(launch.task_id, launch.attempt)  # bounded: Proc._force
    assert not (await job).ok
    assert not still_running, (
        f"the tree ran on past its lease (frozen reported: {frozen}): its shim was stopped"
    )


# A tree that continues one of its own during the freeze: X (in the leader's group, listed
# early), many fillers, and last Y, in a session of its own, continuing X without pause. The
# freeze stops the leader's group, then signals every process once, in /proc order: X is
# stopped again before Y is, and Y, still running, continues X in between.
FREEZE_RACE = """
i=0; (while :; do i=$((i+1)); [ $((i % 2000)) -eq 0 ] && echo x >> {ticks}; done) &
X=$!
n=0; while [ $n -lt 300 ]; do sleep 600 & n=$((n+1)); done
setsid sh -c 'while :; do kill -CONT "$0" 2>/dev/null; done' $X &
echo started > {ready}
wait
"""


async def test_a_tree_that_continues_itself_during_the_freeze_runs_on_frozen(
    backend: LocalBackend, tmp_path: Path
) -> None:
    """`Shim._freeze` SIGSTOPped each process it found once and reported "frozen" without
    checking that the tree was stopped. A process of the tree not yet signalled (Y, listed
    after X, in a session of its own so the group stop misses it) continued X after X's
    stop: the executor reported the attempt frozen (`backend.frozen`, which the node answers
    the heartbeat-monitor's probe with, so that the attempt is judged Lost and retried)
    while X kept working. Now the freeze scans again until every process of the tree is seen
    stopped."""
    ticks, ready = tmp_path / "ticks", tmp_path / "ready"
    launch = replace(command(FREEZE_RACE.format(ticks=ticks, ready=ready)), lease_s=3.0)
    key = (launch.task_id, launch.attempt)
    job = asyncio.create_task(backend.run(launch))
    try:
        await until(lambda: ready.exists() and size(ticks) > 0, "the tree to start")
        await until(lambda: backend.frozen(key), "the lease to lapse and the tree to freeze")
        await asyncio.sleep(0.3)
        still_running = await grows(ticks)
    finally:
        await backend.stop_task(launch.task_id, launch.attempt)
    assert (await job).stopped
    assert not still_running, "a process of the tree ran on while the attempt was 'frozen'"


async def test_a_daemon_outlives_its_attempt_when_the_task_stops_the_warden_first(
    backend: LocalBackend, tmp_path: Path
) -> None:
    """ "The processes it starts — daemons that escape with setsid too — end with its
    attempt" (README). A task starts a daemon, SIGSTOPs the warden (its shim's parent, of
    the same user) and SIGKILLs its own shim. The executor sees the report pipe end and
    ends the attempt at once (a failure, "no exit status": it may be retried), but only the
    warden, as subreaper, kills what a dead shim left — and it was stopped, until some later
    spawn timed out (SPAWN_ANSWER_S, 20 s) and continued it; with no spawn, never. The daemon
    ran on, beside the retry. Now a shim's end without its exit line continues the warden
    and its shims where stopped (Warden.continue_stopped), which then kills what was left."""
    daemon = tmp_path / "daemon.pid"
    script = (
        f"setsid sh -c 'echo $$ > {daemon}; exec sleep 60' & "
        f"while [ ! -s {daemon} ]; do sleep 0.01; done; "
        "W=$(cut -d' ' -f4 /proc/$PPID/stat); kill -STOP $W; kill -KILL $PPID; sleep 60"
    )
    pid = None
    try:
        outcome = await run(backend, command(script, timeout_s=20))
        pid = read_pid(daemon)
        assert pid, "the daemon never started"
        await asyncio.sleep(1.0)
        alive = state(pid) is not None
        assert not outcome.ok, outcome
        assert not alive, f"the daemon outlived its attempt ({outcome.error}, lost={outcome.lost})"
    finally:
        kill_quietly(pid)


async def test_a_handler_s_process_runs_on_beside_its_retry(
    backend: LocalBackend, tmp_path: Path
) -> None:
    """A handler starts a process (a plain subprocess.Popen, not even a daemon) and fails.
    A command's tree is killed at its attempt's end; a handler's was not: the worker lives
    on for the next job and nothing killed what the job started. The attempt was recorded
    Failed and retried while its process still ran — two attempts of one task at once —
    though the README promises "the processes it starts ... end with its attempt". Now the
    worker, a child subreaper, kills what a job left, each child's tree, before it replies."""
    pidfile, ticks = tmp_path / "child.pid", tmp_path / "ticks"
    pid = None
    try:
        outcome = await run(backend, handler("fail_leaving_a_child", [str(pidfile), str(ticks)]))
        assert not outcome.ok
        pid = read_pid(pidfile)
        assert pid, "the child never started"
        await until(lambda: size(ticks) > 0, "the child to start working")
        await asyncio.sleep(0.2)
        still_running = await grows(ticks)
        assert not still_running, "the failed attempt's process runs on after its attempt ended"
    finally:
        kill_quietly(pid)


async def test_a_task_makes_a_restarted_executor_declare_another_node_s_attempt_lost(
    settings: Settings, store: Store, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """state_dir/running is the task's to write (its own user's; its log path, its stdout,
    names the state dir). `Records.reap` reports as "reaped" the key of every `.json` file
    there that parses — even one naming no process it could kill ("it was gone") — and
    `Executor.reaped_lost` then adopted those attempts' leases (adopt_leases checked neither
    the node nor the lease owner) and ended them Lost. A task planted a record naming a
    victim running on another node; at this executor's next start (a crash, a rollout, or the
    task's own SIGKILL of it: same user) the victim's live attempt was declared Lost and
    retried while it still ran on n2. Now reaped_lost adopts only attempts placed on its own
    node (adopt_leases with a node)."""
    victim = await scheduled(store, node="n2", job=sh("sleep 60"), heartbeat_timeout_s=60.0)
    victim = await fsm.apply(store.tasks, victim, State.RUNNING, lease_owner=str(uuid4()))
    state = tmp_path / "state"
    b = LocalBackend(2, state, warm_workers=0)
    await b.start()
    try:
        plant = (
            'd=$(dirname "$(dirname "$(readlink /proc/$$/fd/1)")"); '
            f'printf \'{{"pid": 1, "pgid": 1, "start_time": null}}\' '
            f'> "$d/running/{victim.id}-{victim.attempt}.json"'
        )
        assert (await run(b, command(plant))).ok
    finally:
        await b.close()
    async with running_executor(settings, state):
        await asyncio.sleep(2.0)
        row = await pool.fetchrow("SELECT status, node FROM tasks WHERE id = $1", victim.id)
    assert row["status"] == "running", f"n2's live attempt was made {row['status']} from n1"


async def test_a_directory_planted_at_another_attempt_s_log_fails_it_as_the_task_s_fault(
    backend: LocalBackend,
) -> None:
    """Log paths are predictable (state_dir/logs/<task>-<attempt>.log; a command finds the
    state dir from its stdout). The leader makes its log anew: `os.unlink`, suppressing only
    FileNotFoundError, then O_EXCL. A directory planted there (by this task for its own
    retry, or by any task for another task whose id it read in /proc) made unlink raise
    EISDIR: the attempt "could not start", recorded as the task's own failure (a retry
    spent), never having run — every attempt, for as long as the directory stayed. Now the
    leader removes a directory there too."""
    victim = command("echo hi")
    plant = (
        'd=$(dirname "$(readlink /proc/$$/fd/1)"); '
        f'mkdir "$d/{victim.task_id}-{victim.attempt}.log"'
    )
    assert (await run(backend, command(plant))).ok
    outcome = await run(backend, victim)
    assert outcome.ok, outcome.error
