"""A review of the fifteenth session's own code in the local backend: the per-job restore of a
handler worker's process (jobstate.py) and the live log punch (logcap.py). Each case failed on
that code (the docstrings say what happened, as "happens"/"should"); each test shows it no
longer does. The last two cases, jobs queued behind one that retires its worker and a change
made below os.environ (os.putenv, a C library's setenv), were left then and fixed in the
sixteenth session.

Handlers run in the workers as `tests.integration.test_review5_hostile:<name>`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from services.executor.backends import Launch
from services.executor.backends.local import LocalBackend
from services.executor.backends.local.pool import RECENT_JOBS
from services.executor.backends.local.tickets import Ticket
from services.executor.backends.local.workers import Worker
from shared.models import CommandJob, HandlerJob
from tests.integration.test_worker_state_hostile import one, run  # noqa: F401 (one: a fixture)

HERE = "tests.integration.test_review5_hostile"

# This module's own import-time setup, as many handler modules have (a library's defaults set
# before the libraries that read them are imported: OMP_NUM_THREADS, TF_CPP_MIN_LOG_LEVEL...).
# Only in a handler worker (`python -P .../backends/local/worker.py`), not in pytest.
_main_file = str(getattr(sys.modules.get("__main__"), "__file__", "") or "")
if _main_file.endswith(os.path.join("backends", "local", "worker.py")):
    os.environ.setdefault("PROBE_IMPORT_TIME_SETTING", "1")


# --- handlers (run in the workers) -------------------------------------------------------------


def noop() -> str:
    return "ok"


def block_and_raise(signame: str) -> str:
    """A handler that blocks a signal around its work (a critical section it means to keep
    uninterrupted), gets one meanwhile, and returns with it still blocked (an early return)."""
    sig = getattr(signal, signame)
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
    os.kill(os.getpid(), sig)
    return "ok"


def ignore_signal(signum: int) -> str:
    signal.signal(signum, signal.SIG_IGN)
    return "ok"


def block_signal(signum: int) -> str:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
    return "ok"


def child_status() -> list[str]:
    """What a subprocess this job starts inherits: its SigBlk and SigIgn lines."""
    out = subprocess.run(
        ["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"], capture_output=True, check=True
    ).stdout.decode()
    return out.split()


def own_sigint() -> str:
    def on_int(_sig: int, _frame: Any) -> None:
        pass  # swallow it

    signal.signal(signal.SIGINT, on_int)
    return "ok"


def sigint_handler() -> str:
    return repr(signal.getsignal(signal.SIGINT))


def putenv_left() -> str:
    """A handler (or the C library it calls, which uses setenv) that sets a variable in the
    process's environment without going through os.environ."""
    os.putenv("LEFT_BY_TASK_A", "secret")
    os.unsetenv("PATH")
    return "ok"


def env_of_a_child() -> list[str]:
    out = subprocess.run(
        ["/usr/bin/env"], capture_output=True, check=True, env=None
    ).stdout.decode()
    return sorted(line for line in out.splitlines() if line.startswith(("LEFT_BY", "PATH=")))


def lower_nofile_for_good(n: int) -> int:
    """As in test_worker_state_hostile: a limit the worker cannot raise back (stood for, the
    tests running as root, by a setrlimit that refuses)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    def refuse(*_: Any) -> None:
        raise PermissionError("not permitted")

    resource.setrlimit = refuse  # type: ignore[assignment]
    return os.getpid()


def nofile_and_pid() -> list[int]:
    return [resource.getrlimit(resource.RLIMIT_NOFILE)[0], os.getpid()]


def open_files_and_pid(n: int) -> list[int]:
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]
    for fd in held:
        os.close(fd)
    return [len(held), os.getpid()]


# --- helpers -----------------------------------------------------------------------------------


def handler(name: str, args: Any = None, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}", args=args), timeout_s)


def command(script: str, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, CommandJob(argv=["sh", "-c", script]), timeout_s)


# --- findings ----------------------------------------------------------------------------------


async def test_a_job_that_returns_with_a_signal_blocked_and_pending_is_not_failed(
    one: LocalBackend,
) -> None:
    """A handler blocks SIGUSR2 around its work, receives one meanwhile (pending), and
    returns "ok" with the signal still blocked. After the job, ProcessState.restore() sees the
    mask changed and _put_back_signals() unblocks SIGUSR2 (SIG_SETMASK to the worker's mask)
    with its disposition at SIG_DFL: the pending signal is delivered at once and terminates
    the worker before it writes the reply, so a job that succeeded is recorded "handler worker
    died: killed by SIGUSR2" (a retry spent, or the task failed). Before restore() existed the
    job succeeded. Should: pending signals the job left are discarded (sigtimedwait on
    sigpending(), or SIG_IGN first) before the mask is put back; the job's Success stands."""
    a = await run(one, handler("block_and_raise", ["SIGUSR2"]))
    assert a.ok, f"a job that returned 'ok' was recorded: {a.error}"


@pytest.mark.parametrize("what", ["ignored", "blocked"])
async def test_a_realtime_signal_a_job_changed_is_put_back(one: LocalBackend, what: str) -> None:
    """restore() looks for changed signal state in fields 32-34 of /proc/self/stat (a05b856,
    to save 30 us). The kernel prints those masks as `sig[0] & 0x7fffffff`: signals 1-31
    only. A job that ignores or blocks a real-time signal (SIGRTMIN+n: used by timers,
    threading libraries, glibc's own) is not seen, nothing is put back, and every later job
    of other tasks runs with it — and every subprocess they start inherits it across exec
    (ignored and blocked dispositions survive exec). Should: the masks read from
    /proc/self/status (SigBlk/SigIgn/SigCgt, all 64), or compared in full another way."""
    before = await run(one, handler("child_status"))
    assert before.ok, before.error
    rt = signal.SIGRTMIN + 3
    name = "ignore_signal" if what == "ignored" else "block_signal"
    assert (await run(one, handler(name, [int(rt)]))).ok
    after = await run(one, handler("child_status"))
    assert after.ok, after.error
    assert after.result == before.result, (
        f"task B's subprocess inherits task A's {what} SIGRTMIN+3: {after.result} "
        f"(was {before.result})"
    )


async def test_a_python_handler_a_job_swapped_on_a_caught_signal_is_put_back(
    one: LocalBackend,
) -> None:
    """A job replaces the worker's SIGINT handler (Python's default_int_handler) with its own.
    The signal was caught before and is caught after, so the sigcatch mask restore() compares
    is unchanged and _put_back_signals() never runs: the next task's job runs with the first
    task's Python function as its SIGINT handler (and its closure alive). Should: compare the
    Python-level handlers too (signal.getsignal for the few caught signals), not only the
    kernel's masks."""
    before = await run(one, handler("sigint_handler"))
    assert (await run(one, handler("own_sigint"))).ok
    after = await run(one, handler("sigint_handler"))
    assert after.result == before.result, f"task B runs with task A's handler: {after.result}"


async def test_a_live_logs_tail_shows_its_output_not_the_punched_hole(tmp_path: Path) -> None:
    """With SKED_LOG_MAX_BYTES at its minimum (64 KiB), a live cut punches the log's head out
    and keeps ~32 KiB of data; the live log a heartbeat probe asks for (log_tail, LIVE_LOG_CHARS
    = 64 KiB) reads the last 64 KiB of the file, hole included: tens of KiB of NULs, which
    service.py escapes as `\\0` text — the live log a user sees is mostly `\\0\\0\\0`, the
    output pushed out of it. Before the punch (rewrite) the file held only data. Should:
    tail() starts at the first data at or after its offset (SEEK_DATA), as the compaction's
    _data does."""
    b = LocalBackend(1, tmp_path / "state", warm_workers=0, log_max_bytes=64 * 1024)
    await b.start()
    watching = asyncio.create_task(b.watch())
    launch = command("i=0; while [ $i -lt 20000 ]; do echo line $i; i=$((i+1)); done; sleep 20", 40)
    task = asyncio.create_task(b.run(launch))
    try:
        path = tmp_path / "state" / "logs" / f"{launch.task_id}-1.log"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the bound's own period (CHECK_S) is the event
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if st.st_size > 64 * 1024 and st.st_blocks * 512 < st.st_size:
                    break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the live log was never cut")
        text = await b.log_tail((launch.task_id, 1), 64 * 1024)
        assert text is not None
        assert "\x00" not in text, f"the live log's tail holds {text.count(chr(0))} NULs"
    finally:
        watching.cancel()
        async with asyncio.timeout(40):
            await b.close()
            await asyncio.gather(task, watching, return_exceptions=True)


def import_time_setting() -> str | None:
    return os.environ.get("PROBE_IMPORT_TIME_SETTING")


async def test_a_handler_modules_import_time_setup_lasts_past_its_first_job(
    one: LocalBackend,
) -> None:
    """A handler module sets a process-wide default when imported (here
    os.environ.setdefault(...), as modules do for OMP_NUM_THREADS or TF_CPP_MIN_LOG_LEVEL before
    importing what reads them; the same goes for a signal handler or a raised RLIMIT_NOFILE
    soft limit set at import). The worker imports it inside the first job that names it
    (Worker.resolve, in _call), so restore() counts the import's changes as that job's and
    undoes them; the module stays imported (sys.modules, self.handlers) and never runs its
    setup again. The first job of a handler sees the setting, every later one on that worker
    does not: the same task behaves differently depending on whether it was the first on its
    worker. Should: what an import does is the worker's (resolve the handler, and take the
    state snapshot again after a fresh import, before the job's env and handler run)."""
    first = await run(one, handler("import_time_setting"))
    second = await run(one, handler("import_time_setting"))
    assert first.ok, first.error
    assert second.ok, second.error
    assert second.result == first.result, (
        f"the module's import-time setting was {first.result!r} in its first job, "
        f"{second.result!r} in the next"
    )


def leave_helpers_and_a_timer(n: int, seconds: float) -> str:
    """A handler that starts helpers and returns without waiting for them, its own deadline
    timer (setitimer, SIGALRM at its default) still armed: it finished in time."""
    for _ in range(n):
        subprocess.Popen(["sleep", "300"])
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return "ok"


async def test_a_timer_a_job_left_armed_does_not_kill_its_worker_before_the_reply(
    one: LocalBackend,
) -> None:
    """A handler starts 300 helpers, arms a 10 ms timer (SIGALRM at its default) and returns
    "ok". After the job the worker first ends the helpers (_children/_end: a kill and a reap
    each, a few hundred ms), and only then does restore() disarm the timers: the timer fires
    meanwhile and SIGALRM's default action kills the worker before the reply is written. The
    job that succeeded is recorded "handler worker died: killed by SIGALRM". Should: timers
    disarmed (and the job's signal state put back) right after the handler returns, before
    the leftovers are ended; restore()'s docstring says "disarmed first"."""
    a = await run(one, handler("leave_helpers_and_a_timer", [300, 0.01]), limit=60)
    assert a.ok, f"a job that returned 'ok' was recorded: {a.error}"


async def test_a_job_queued_behind_one_that_retires_its_worker_runs_in_a_fresh_one(
    one: LocalBackend,
) -> None:
    """Job B, given to a worker behind job A while the node's jobs ran short, ran in that
    worker after A changed it past putting back (a soft limit of open files lowered to 64,
    with no way to raise it): B ran with A's limit, in A's process; only the job after was
    given a fresh worker. Now a worker exits right after the reply that retires it, starting
    nothing more, and what waited behind comes back unstarted and runs in a fresh worker."""
    for _ in range(RECENT_JOBS + 1):  # (the first, which imports this module, drops out)
        assert (await run(one, handler("noop"))).ok
    pool = one._pool
    assert pool.short()
    pool.rescue_s = 60.0  # no nudge takes B back: it stays behind A
    given: list[tuple[str, int]] = []
    submit = pool.submit

    def recorded(worker: Worker, message: bytes, job: str, timeout: float | None) -> Ticket:
        given.append((job, worker.pid))
        return submit(worker, message, job, timeout)

    pool.submit = recorded  # type: ignore[method-assign]
    a_launch, b_launch = handler("lower_nofile_for_good", [64]), handler("nofile_and_pid")
    a, b = await asyncio.gather(run(one, a_launch), run(one, b_launch))
    assert a.ok, a.error
    assert b.ok, b.error
    b_stem = f"{b_launch.task_id}-1"
    assert given[0][1] == a.result, given
    assert (b_stem, a.result) in given, f"B was not given to A's worker: {given}"
    limit, pid = b.result
    assert pid != a.result, "B ran in the worker A changed for good"
    assert limit != 64


async def test_a_variable_a_job_set_below_os_environ_is_not_the_next_jobs(
    one: LocalBackend,
) -> None:
    """Job A sets a variable and unsets PATH with os.putenv / os.unsetenv (as a C library's
    setenv does): below os.environ, which the worker compared and put back, so the change
    stayed, and every later job's subprocess (exec() passes the C environment on) got A's
    variable and no PATH. Said in docs/architecture.md as beyond the worker until the
    sixteenth session. Now the worker marks the C environment's array of pointers as each job
    is given it, and puts back what changed below os.environ as os.environ has it."""
    before = await run(one, handler("env_of_a_child"))
    assert before.ok, before.error
    a = await run(one, handler("putenv_left"))
    assert a.ok, a.error
    b = await run(one, handler("env_of_a_child"))
    assert b.ok, b.error
    assert b.result == before.result, "the next job's subprocess got A's environment"
