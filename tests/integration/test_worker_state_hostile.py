"""A hostile (or merely careless) task's process tree under the local backend: what one
attempt leaves in a reused handler worker or shim, and what it leaves running. Each case was
found by an adversarial review, where it failed: the docstrings say what happened; each test
shows it no longer does (services/executor/backends/local/jobstate.py, worker.py).

Handlers the tests run are defined here and run in the handler workers as
`tests.integration.test_worker_state_hostile:<name>`. Every test uses a backend of one slot, so that
consecutive handler jobs — attempts of different tasks — run in the same worker, as they do
on any node whose worker is free."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from services.executor.backends import Launch, Outcome
from services.executor.backends.local import LocalBackend
from shared.models import CommandJob, HandlerJob

HERE = "tests.integration.test_worker_state_hostile"


# --- handlers (run in the workers) -------------------------------------------------------------


def ignore_sigchld() -> str:
    """A handler that does not want zombies from the helpers it starts (a common idiom)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    return "ok"


def exit_code_of_false() -> int:
    return subprocess.run(["false"], check=False).returncode


def arm_a_timer(seconds: float) -> str:
    """A handler bounding its own work with an interval timer, returning before it fires
    (and, as happens on an early return or an exception path, without disarming it)."""

    def on_alarm(_sig: int, _frame: Any) -> None:
        raise TimeoutError("the first job's own alarm")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return "ok"


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def lower_nofile(n: int) -> str:
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return "ok"


def open_files(n: int) -> int:
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]
    for fd in held:
        os.close(fd)
    return len(held)


def work_in_a_scratch_dir(where: str) -> str:
    os.makedirs(where, exist_ok=True)
    os.chdir(where)
    os.rmdir(where)  # cleaned up after itself
    return "ok"


def cwd() -> str:
    return os.getcwd()


def set_umask(mask: int) -> int:
    return os.umask(mask)


def get_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def edit_environ() -> str:
    os.environ["LEFT_BY_THE_FIRST_TASK"] = "secret"
    os.environ.pop("PATH", None)
    return "ok"


def read_environ() -> list[str | None]:
    return [os.environ.get("LEFT_BY_THE_FIRST_TASK"), os.environ.get("PATH")]


def leave_children(n: int) -> float:
    """Start `n` helpers and return without waiting for them; how long that took."""
    t = time.monotonic()
    for _ in range(n):
        subprocess.Popen(["sleep", "300"])
    return time.monotonic() - t


def child_from_a_raw_thread(pidfile: str) -> str:
    """A helper started from a thread made by `_thread` (as C extensions' native threads are:
    `threading` does not count them), which then waits on it."""
    import _thread

    def body() -> None:
        child = subprocess.Popen(["sleep", "300"])
        Path(pidfile).write_text(str(child.pid))
        child.wait()

    _thread.start_new_thread(body, ())
    while not Path(pidfile).exists():
        time.sleep(0.01)
    return "ok"


def close_stdout() -> str:
    """A handler that closes its standard output when done with it (as a CLI's main might)."""
    sys.stdout.close()
    return "ok"


def renice(by: int) -> int:
    return os.nice(by)


def niceness() -> int:
    return os.nice(0)


def say_hi() -> str:
    print("hi")  # noqa: T201
    return "ok"


# --- helpers -----------------------------------------------------------------------------------


def handler(name: str, args: Any = None, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}", args=args), timeout_s)


def command(script: str, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, CommandJob(argv=["sh", "-c", script]), timeout_s)


async def run(backend: LocalBackend, launch: Launch, limit: float = 30) -> Outcome:
    async with asyncio.timeout(limit):
        return await backend.run(launch)


def alive(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return raw[raw.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X")


@pytest.fixture
async def one(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    """One slot: every handler job runs in the same worker, every command under one shim."""
    b = LocalBackend(1, tmp_path / "state", warm_workers=0)
    await b.start()
    yield b
    async with asyncio.timeout(40):
        await b.close()


# --- findings ----------------------------------------------------------------------------------


async def test_a_handler_that_ignores_sigchld_makes_no_later_failing_subprocess_succeed(
    one: LocalBackend,
) -> None:
    """Task A's handler sets SIGCHLD to SIG_IGN in its worker (to be rid of zombies) and
    succeeds. The worker keeps the disposition; task B's handler, next in that worker, runs
    `subprocess.run(["false"])`: the kernel reaps the child itself, Python's wait gets ECHILD
    and reports returncode 0. B's check of its helper's exit code passes on a failure and B
    was recorded a Success with a wrong result. Now each job starts with the worker's own
    signal dispositions (B sees returncode 1), as every command attempt does."""
    assert (await run(one, handler("exit_code_of_false"))).result == 1
    assert (await run(one, handler("ignore_sigchld"))).ok
    b = await run(one, handler("exit_code_of_false"))
    assert b.ok, b.error
    assert b.result == 1, f"task B's `false` exited {b.result}: the previous job's SIG_IGN leaked"


async def test_a_timer_a_handler_left_armed_fails_no_later_job(one: LocalBackend) -> None:
    """Task A's handler arms an interval timer (setitimer/alarm, with a SIGALRM handler that
    raises) to bound its own work, and returns before it fires. Task B runs next in the same
    worker; half a second in, A's timer fired and A's handler raised inside B: B failed with
    "TimeoutError: the first job's own alarm" (a retry spent, or its last) for something it
    never did. Without A's handler (default SIGALRM) the worker itself died in B's job. Now a
    job's timers are disarmed and its signal handlers put back when it ends."""
    assert (await run(one, handler("arm_a_timer", [0.5]))).ok
    b = await run(one, handler("nap", [1.0]))
    assert b.ok, f"task B failed for task A's timer: {b.error}"


@pytest.mark.parametrize("what", ["rlimit", "nice", "cwd", "umask", "environ"])
async def test_process_state_a_job_changed_is_put_back(
    one: LocalBackend, tmp_path: Path, what: str
) -> None:
    """Each job in a handler worker inherits whatever the jobs before it — other tasks'
    attempts — did to the process: A lowers RLIMIT_NOFILE to 32 (bounding itself; a hard
    limit cannot be raised back) and B fails "Too many open files"; A chdirs into a scratch
    directory and removes it, and B's os.getcwd() (and every relative path) fails; A sets
    umask 0o777 and B makes files no one can open; A sets an environment variable and drops
    PATH through os.environ, and B sees A's value and runs with no PATH. JobEnv undid only
    the variables of a job's own `env`. Now the worker puts each back after every job (or,
    where it cannot, is retired: the next test)."""
    if what == "rlimit":
        assert (await run(one, handler("lower_nofile", [32]))).ok
        b = await run(one, handler("open_files", [100]))
        assert b.ok, f"task B: {b.error}"
        assert b.result == 100
    elif what == "nice":
        before = (await run(one, handler("niceness"))).result
        assert (await run(one, handler("renice", [19]))).ok
        b = await run(one, handler("niceness"))
        assert b.result == before, f"task B runs at task A's niceness {b.result}"
    elif what == "cwd":
        before = (await run(one, handler("cwd"))).result
        assert (await run(one, handler("work_in_a_scratch_dir", [str(tmp_path / "s")]))).ok
        b = await run(one, handler("cwd"))
        assert b.ok, f"task B: {b.error}"
        assert b.result == before
    elif what == "umask":
        before = (await run(one, handler("get_umask"))).result
        assert (await run(one, handler("set_umask", [0o777]))).ok
        b = await run(one, handler("get_umask"))
        assert b.result == before, f"task B runs with task A's umask {b.result:o}"
    else:
        before = (await run(one, handler("read_environ"))).result
        assert (await run(one, handler("edit_environ"))).ok
        b = await run(one, handler("read_environ"))
        assert b.result == before, f"task B sees task A's environment: {b.result}"


async def test_a_handler_that_leaves_a_few_hundred_helpers_ends_them_in_time(
    one: LocalBackend,
) -> None:
    """A handler starts 600 helpers and returns (in a second or two) without waiting for
    them. The worker kills what a job left before it replies (`worker._end`), but lists each
    child's descendants with its own full scan of /proc — one scan per child, each reading
    every process's stat: quadratic. Here 400 helpers took ~15 s to end (100: ~3 s); 600
    take longer than the task's 12 s timeout, so an attempt whose handler returned at once
    was killed and recorded TimedOut (a retry spent), its helpers running on meanwhile. Now
    one scan of /proc a round finds every child's tree (proctree.descendants)."""
    started = time.monotonic()
    outcome = await run(one, handler("leave_children", [600], timeout_s=12.0), limit=60)
    took = time.monotonic() - started
    assert outcome.ok, f"{outcome.error} after {took:.1f} s (the handler itself: a second or two)"


async def test_a_helper_started_from_a_native_thread_ends_with_its_job(
    one: LocalBackend, tmp_path: Path
) -> None:
    """ "What a job started and left running is killed, each child's whole tree, before its
    reply." The worker finds a job's children in /proc/<pid>/task/<tid>/children, and read
    every thread's file only when `threading.active_count() > 1`; a thread `threading` does
    not know (made by `_thread`, or a C extension's native thread) was not counted, so a
    helper it started was missed: it ran on after the attempt ended, beside the next job and
    the task's retry. Now every thread's file is read, whatever `threading` counts."""
    pidfile = tmp_path / "helper.pid"
    pid = None
    try:
        assert (await run(one, handler("child_from_a_raw_thread", [str(pidfile)]))).ok
        pid = int(pidfile.read_text())
        assert not alive(pid), "the job's helper outlived its attempt"
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_a_command_runs_with_no_signal_ignored(one: LocalBackend) -> None:
    """The warden is a Python process, and Python ignores SIGPIPE and SIGXFSZ at start; the
    leader put SIGPIPE (and SIGCHLD, SIGTERM, SIGINT) back to the default before its exec,
    but not SIGXFSZ, and an ignored signal stays ignored across exec: every command ran with
    SIGXFSZ ignored, so one bounded by `ulimit -f` got EFBIG and carried on instead of being
    stopped at its limit; and with whatever the executor was started ignoring (nohup's SIGHUP,
    a background job's SIGQUIT: the first CI run of the fix failed so). Now every signal
    ignored in the warden is put back to the default in the leader."""
    outcome = await run(one, command("grep SigIgn /proc/self/status"))
    assert outcome.ok
    assert outcome.log_tail.split() == ["SigIgn:", "0000000000000000"], outcome.log_tail


async def test_a_handler_that_closes_sys_stdout_fails_no_later_job_that_prints(
    one: LocalBackend,
) -> None:
    """Task A's handler closes sys.stdout and succeeds. After each job the worker put
    `sys.stdout = sys.__stdout__` back — the very object A closed — so every later job on
    that worker, other tasks' attempts, failed at its first print with "ValueError: I/O
    operation on closed file." until the worker was retired (10,000 jobs); had A closed
    sys.stderr too, `_failure`'s own write to it raised and the worker died. Now the worker
    opens its streams again on fds 1 and 2 when it finds them closed, and `_failure` does
    not raise on a closed stderr."""
    assert (await run(one, handler("close_stdout"))).ok
    b = await run(one, handler("say_hi"))
    c = await run(one, handler("say_hi"))
    assert b.ok, f"task B: {b.error!r}"
    assert c.ok, f"task C: {c.error!r}"


def lower_nofile_for_good(n: int) -> int:
    """A job that lowers a limit the worker cannot raise back (as an unprivileged worker
    cannot a hard limit: stood for here, the tests running as root, by a setrlimit that
    refuses)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    def refuse(*_: Any) -> None:
        raise PermissionError("not permitted")

    resource.setrlimit = refuse  # type: ignore[assignment]
    return os.getpid()


def my_pid() -> int:
    return os.getpid()


async def test_a_worker_a_job_changed_past_putting_back_is_retired(one: LocalBackend) -> None:
    """What a worker cannot put back after a job (a hard limit lowered, a niceness raised,
    without the privilege to undo either) retires it: its reply says so and the next job
    runs in a fresh worker, with the limit the worker started with."""
    a = await run(one, handler("lower_nofile_for_good", [64]))
    assert a.ok, a.error
    b = await run(one, handler("my_pid"))
    assert b.ok, b.error
    assert b.result != a.result, "the next job ran in the worker the last one changed"
    c = await run(one, handler("open_files", [100]))
    assert c.ok, c.error
