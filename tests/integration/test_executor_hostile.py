"""The executor's local backend against hostile tasks: each case, found by an adversarial
review, once hung the executor's loop or an attempt, failed another task's job, killed a worker
or kept the node from restarting; now the hostile attempt alone ends, with a reason.

The handlers the tests run are defined here and run in the handler workers as
`tests.integration.test_executor_hostile:<name>`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from services.executor.backends import Launch, Outcome
from services.executor.backends.local import LocalBackend, process
from services.executor.backends.local.pool import RECENT_JOBS
from shared.models import CommandJob, HandlerJob
from tests.helpers import loop_stalls

HERE = "tests.integration.test_executor_hostile"


# --- handlers (run in the workers) -------------------------------------------------------------


def lone_surrogate() -> str:
    """A result Python's json encodes (as the escape \\ud800) but not every parser reads."""
    return "text \ud800 more"


def deep(levels: int) -> Any:
    """A list nested `levels` deep: within json.dumps's reach."""
    value: Any = []
    for _ in range(levels):
        value = [value]
    return value


def raise_surrogate() -> None:
    raise ValueError("bad \udc80 input")


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def raise_unprintable() -> None:
    raise Unprintable


class Unlistable(dict):  # type: ignore[type-arg]
    def items(self) -> Any:
        raise RuntimeError("no items for you")


def unlistable_result() -> Any:
    return Unlistable(a=1)


def pid_of_worker() -> int:
    import os

    return os.getpid()


# --- helpers -----------------------------------------------------------------------------------


def command(script: str, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, CommandJob(argv=["sh", "-c", script]), timeout_s)


def handler(name: str, args: Any = None, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}", args=args), timeout_s)


async def run(backend: LocalBackend, launch: Launch) -> Outcome:
    async with asyncio.timeout(30):
        return await backend.run(launch)


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    b = LocalBackend(2, tmp_path / "state", warm_workers=0)
    await b.start()
    yield b
    await b.close()


async def short_jobs_backend(tmp_path: Path, slots: int = 2) -> LocalBackend:
    """A backend whose every worker has imported this module (as a handler run before would
    have) and whose recent jobs ran short, so that a job may wait at a busy worker."""
    b = LocalBackend(slots, tmp_path / "state", warm_workers=slots)
    await b.start()
    first = await asyncio.gather(*(run(b, handler("deep", [1])) for _ in range(slots)))
    assert all(o.ok for o in first), first
    noop = HandlerJob(handler="tests.handlers:noop")
    for _ in range(RECENT_JOBS):  # the imports' run times out of the recent jobs
        assert (await run(b, Launch(uuid4(), 1, noop, None))).ok
    assert b._pool.short()
    return b


# --- findings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args"),
    [("lone_surrogate", None), ("deep", [300]), ("raise_surrogate", None)],
)
async def test_a_reply_the_executor_cannot_parse_fails_the_innocent_job_behind_it(
    tmp_path: Path, name: str, args: Any
) -> None:
    """The worker encodes replies with json.dumps; the executor reads them with pydantic's
    parser, which refuses a lone surrogate escape and nesting past ~200 levels. Such a reply
    was read as a protocol breach: the worker was killed and the job waiting behind it —
    another task's — failed, though it never started. The worker now writes only what the
    executor reads: surrogates escaped as `outcome.storable` would, too deep refused."""
    b = await short_jobs_backend(tmp_path)
    try:
        hostile = asyncio.create_task(run(b, handler(name, args)))
        add = HandlerJob(handler="tests.handlers:add", args=[1, 2])
        innocent = asyncio.create_task(run(b, Launch(uuid4(), 1, add, None)))
        bad, good = await hostile, await innocent
    finally:
        await b.close()
    # the job behind it is another task's: it must run (elsewhere, or after it) and succeed
    assert (good.ok, good.result) == (True, 3), (good, bad)
    # the hostile job's own outcome: a failure naming its result (or its error), not a breach
    assert "not this job's reply" not in (bad.error or ""), bad


async def test_a_command_that_makes_its_output_path_a_directory(tmp_path: Path) -> None:
    """$SKED_OUTPUT replaced by a directory: the attempt fails saying so. Before, the clean-up
    `unlink` raised from `run` (which promises never to for a task) and the directory stayed
    in state_dir/io, where the next executor's start() failed on it: the node could not come
    back on its state dir."""
    state = tmp_path / "state"
    problems = []
    b = LocalBackend(1, state, warm_workers=0)
    await b.start()
    try:
        try:
            outcome = await run(b, command('rm -f "$SKED_OUTPUT"; mkdir "$SKED_OUTPUT"'))
            if outcome.ok:
                problems.append(f"a directory as declared output succeeded: {outcome}")
        except Exception as exc:
            problems.append(f"LocalBackend.run raised for the task: {exc!r}")
    finally:
        await b.close()
    again = LocalBackend(1, state, warm_workers=0)
    try:
        await again.start()
    except Exception as exc:
        problems.append(f"the next executor on this state dir cannot start: {exc!r}")
    finally:
        await again.close()
    assert problems == []


async def test_a_log_path_made_a_directory_stops_log_retention(backend: LocalBackend) -> None:
    """A command finds its log file (/proc/self/fd/1) and replaces it with a directory dated
    in the past: os.unlink raised IsADirectoryError and the whole pass failed, every later one
    too, keeping every old log. Now it is removed like the rest."""
    old = command("true")
    assert (await run(backend, old)).ok
    hostile = command(
        'log=$(readlink /proc/$$/fd/1); rm -f "$log"; mkdir "$log"; touch -d 2000-01-01 "$log"'
    )
    assert (await run(backend, hostile)).ok
    logs = backend.state_dir / "logs"
    for name in ("a", "b", "c", "d", "e", "f"):
        old_log = logs / f"{uuid4()}-1.log"
        old_log.write_text(name)
        os.utime(old_log, (946684800, 946684800))  # 2000-01-01
    os.utime(logs / f"{old.task_id}-1.log", (946684800, 946684800))
    try:
        await backend.prune(86_400, set())
    except OSError as exc:
        pytest.fail(f"pruning raised: {exc!r}")
    left = [p.name for p in logs.iterdir() if p.is_file()]
    assert left == [], left


async def test_a_log_path_made_a_fifo_blocks_the_executor_s_event_loop(
    backend: LocalBackend,
) -> None:
    """A command replaces its log file with a FIFO. The backend read the log's tail with a
    blocking open() on the event loop's thread, and opening a FIFO for reading waits for a
    writer that never comes: the executor's loop hung for good — no lease renewals (every
    attempt on the node frozen, then Lost), no outcomes, no probes. Now a log is read only if
    it is a regular file, opened without waiting. (A watchdog thread here plays the writer
    after 3 s, so that a regression fails rather than hangs.)"""
    launch = command(
        'log=$(readlink /proc/$$/fd/1); rm -f "$log"; mkfifo "$log"; echo planted > /dev/null'
    )
    fifo = backend.state_dir / "logs" / f"{launch.task_id}-1.log"
    rescued = threading.Event()
    done = threading.Event()

    def watchdog() -> None:
        if done.wait(3.0):
            return
        try:
            if stat.S_ISFIFO(os.stat(fifo).st_mode):
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # only with a reader there
                rescued.set()
                os.close(fd)
        except OSError:
            pass

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    try:
        async with loop_stalls() as gaps:
            outcome = await run(backend, launch)
    finally:
        done.set()
        thread.join(5)
    assert outcome.ok
    assert not rescued.is_set(), "the event loop was blocked opening the FIFO until rescued"
    assert max(gaps, default=0.0) < 1.0, f"the event loop stalled {max(gaps):.1f} s"


async def test_a_fifo_planted_at_the_next_attempt_s_log_hangs_that_attempt(
    backend: LocalBackend,
) -> None:
    """Log paths are predictable (state_dir/logs/<task>-<attempt>.log, and a command finds
    state_dir from its own stdout). Attempt 1 plants a FIFO where attempt 2's log will be;
    attempt 2's leader opened its log (O_TRUNC) before exec and blocked there for a reader,
    before the run timeout was armed and where no stop reached it: the attempt never ended.
    Now the leader makes its log anew (unlinked, then O_EXCL|O_NOFOLLOW)."""
    task_id = uuid4()
    plant = 'd=$(dirname "$(readlink /proc/$$/fd/1)"); mkfifo "$d/${SKED_TASK_ID}-2.log"'
    first = Launch(task_id, 1, CommandJob(argv=["sh", "-c", plant]), None)
    assert (await run(backend, first)).ok
    fifo = backend.state_dir / "logs" / f"{task_id}-2.log"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    second = Launch(task_id, 2, CommandJob(argv=["sh", "-c", "echo hi"]), 1.0)
    attempt = asyncio.create_task(backend.run(second))
    try:
        done, _ = await asyncio.wait({attempt}, timeout=5.0)
        ended = bool(done)
        if not ended:
            stopper = asyncio.create_task(backend.stop_task(task_id, 2))
            done, _ = await asyncio.wait({stopper}, timeout=2.0)
            stopped = bool(done)
        else:
            stopped = True
    finally:
        # unblock the leader's open(): a reader comes, the leader runs and is stopped
        # and a writer, held open, so that the read of its tail (the test above) is not
        # blocked either
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            async with asyncio.timeout(10):
                await backend.stop_task(task_id, 2)
                await asyncio.wait({attempt})
        finally:
            os.close(writer)
            os.close(reader)
    assert ended, "attempt 2 (timeout 1 s) had not ended after 5 s"
    assert stopped, "and a stop did not end it either"


@pytest.mark.parametrize("name", ["raise_unprintable", "unlistable_result", "deep_100k"])
async def test_a_handler_error_that_escapes_the_worker_s_guard_ends_its_worker(
    backend: LocalBackend, name: str
) -> None:
    """A handler must not end its worker, nor what it returns or raises: an exception whose
    __str__ raises, a dict subclass whose items() raises, a result nested deeper than
    json.dumps reaches. These escaped the worker's guard: the job failed as "handler worker
    died" instead of with its own error, and the worker (with what it cached) was replaced."""
    launch = handler("deep", [100000]) if name == "deep_100k" else handler(name)
    before = (await run(backend, handler("pid_of_worker"))).result
    outcome = await run(backend, launch)
    after = (await run(backend, handler("pid_of_worker"))).result
    assert not outcome.ok
    assert not (outcome.error or "").startswith("handler worker died"), outcome.error
    assert before == after, "the handler's worker died"


def stop_my_shim() -> None:
    """A handler that stops its own supervisor (its worker's parent), then waits."""
    os.kill(os.getppid(), signal.SIGSTOP)
    time.sleep(60)


@pytest.mark.parametrize("kind", ["command", "handler"])
async def test_a_task_that_stops_its_own_shim_still_ends(backend: LocalBackend, kind: str) -> None:
    """A task can SIGSTOP its shim (its parent, of its user): the shim then neither stops the
    tree at the timeout nor reports, and the attempt never ended. Now a shim that has not
    answered a stop or a kill in time is killed from the executor with the tree's group; the
    attempt ends as timed out, and the backend runs the next one."""
    if kind == "command":
        hostile = command("kill -STOP $PPID; sleep 60", timeout_s=1.0)
    else:
        hostile = handler("stop_my_shim", timeout_s=1.0)
    async with asyncio.timeout(30):
        outcome = await backend.run(hostile)
    assert not outcome.ok
    assert outcome.timed_out, outcome
    assert (await run(backend, command("true"))).ok
    assert (await run(backend, handler("pid_of_worker"))).ok


async def hog_cpus(n: int) -> list[asyncio.subprocess.Process]:
    """`n` busy processes of the test's own (it stops them by pid): a loaded host."""
    loop = "while :; do :; done"
    return [await asyncio.create_subprocess_exec("sh", "-c", loop) for _ in range(n)]


async def test_a_task_that_stops_its_shim_at_once_still_ends(tmp_path: Path) -> None:
    """The shim reported its leader's pid (and its own) only after the exec, so a program that
    stopped its shim at once — before the shim ran again, as on a loaded host it does — left
    the executor without a pid to kill: the attempt ignored its timeout and a stop, and the
    backend's close waited for it for ever (the hang of a CI run). The pids now go out before
    the program can run."""
    b = LocalBackend(6, tmp_path / "state", warm_workers=0)
    await b.start()
    hogs = await hog_cpus(4)
    try:
        hostile = [command("kill -STOP $PPID; sleep 60", timeout_s=1.0) for _ in range(6)]
        async with asyncio.timeout(45):
            outcomes = await asyncio.gather(*(b.run(h) for h in hostile))
        assert all(o.timed_out for o in outcomes), outcomes
    finally:
        for hog in hogs:
            hog.kill()
            await hog.wait()
        async with asyncio.timeout(30):
            await b.close()


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append(int(entry))
    return found


@pytest.mark.parametrize("stopped", ["idle shim", "warden"])
async def test_a_stopped_shim_or_warden_hands_its_attempt_back_and_is_continued(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch, stopped: str
) -> None:
    """Any process of the executor's user can SIGSTOP an idle shim, or the warden. The
    attempt handed to it then never started, ignored its timeout and a stop, and kept a slot
    for ever (a stopped warden: every attempt after it too). A spawn that no shim answers in
    time now goes back as a launch failure, no retry spent, and what was stopped is
    continued: the attempt it held never runs, and the next runs as usual."""
    monkeypatch.setattr(process, "SPAWN_ANSWER_S", 2.0)
    assert (await run(backend, command("true"))).ok  # leaves one shim idle
    warden = backend._warden._proc
    assert warden is not None
    targets = children(warden.pid) if stopped == "idle shim" else [warden.pid]
    assert targets, "no idle shim"
    for pid in targets:
        os.kill(pid, signal.SIGSTOP)
    marker = backend._io / "ran"
    try:
        outcome = await run(backend, command(f"touch {marker}", timeout_s=1.0))
        assert not outcome.ok
        assert outcome.unstarted, outcome
        assert (outcome.error or "").startswith("could not start: no shim answered"), outcome
        assert all(process.proctree.stat(pid).state != "T" for pid in targets)  # type: ignore[union-attr]
        assert (await run(backend, command("true"))).ok
        assert not marker.exists(), "the abandoned attempt ran after all"
    finally:
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


# A backend whose attempts a task of the same user attacks through /proc/<pid>/fd: run apart,
# without CAP_SYS_PTRACE (setpriv), as an unprivileged executor runs — root with it opens
# every process's descriptors, dumpable or not, and the tests run as root.
FORGER = """
import asyncio, json, sys
from pathlib import Path
from services.executor.backends.local import LocalBackend
from tests.integration.test_executor_hostile import command, handler

async def main() -> None:
    b = LocalBackend(2, Path(sys.argv[1]), warm_workers=0)
    await b.start()
    try:
        victim = handler("sleep_for", [8]) if sys.argv[2] == "handler" else command("sleep 8")
        victim = type(victim)(victim.task_id, 1, victim.job, 4.0)
        ran = asyncio.create_task(b.run(victim))
        while not b._runs or next(iter(b._runs.values())).proc is None:
            await asyncio.sleep(0.05)
        proc = next(iter(b._runs.values())).proc
        target = proc.pid if sys.argv[2] == "handler" else proc.shim_pid
        forge = (
            f"for f in /proc/{target}/fd/*; do "
            f"printf 'exit 0 exited\\\\n' 2>/dev/null > $f && echo wrote $f; done; true"
        )
        hostile = await b.run(command(forge))
        outcome = await ran
        print(json.dumps({"wrote": hostile.log_tail, "ok": outcome.ok, "error": outcome.error}))
    finally:
        await b.close()

asyncio.run(main())
"""


def sleep_for(seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
@pytest.mark.parametrize("victim", ["command", "handler"])
async def test_a_task_cannot_forge_another_attempts_exit_through_proc(
    tmp_path: Path, victim: str
) -> None:
    """The warden, its shims and the handler workers were dumpable: any process of the
    executor's user could open their /proc/<pid>/fd and write to another attempt's pipes.
    `exit 0 exited` on a shim's report pipe ended a command still running as a success; a
    line on a worker's pipes forged or injected other tasks' jobs. They are now closed to
    their user like the services, and the victim runs to its own end (its timeout here)."""
    cmd = ["setpriv", "--bounding-set=-sys_ptrace", sys.executable, "-c", FORGER]
    child = await asyncio.create_subprocess_exec(
        *cmd, str(tmp_path / "state"), victim, stdout=asyncio.subprocess.PIPE, cwd=os.getcwd()
    )
    try:
        async with asyncio.timeout(60):
            out, _ = await child.communicate()
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert child.returncode == 0
    got = json.loads(out.decode().strip().splitlines()[-1])
    assert got["wrote"] == "", f"the task opened the victim's pipes: {got['wrote']}"
    assert not got["ok"], got
    assert got["error"] == "timed out after 4.0 s", got
