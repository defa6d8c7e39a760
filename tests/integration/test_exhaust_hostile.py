"""A task that abuses its node's resources through the local backend (handler workers, the
warden and its shims): the sixteenth session's probe. Each case failed then (the docstrings
say what happened, and what happens now). Held up then: a command's hopper (with or without
setsid), a handler closing every descriptor or pointing them at /dev/null, ~5 GB printed at
full speed under a log bound, a handler SIGSTOPping its own worker, a 50 GiB sparse stdout.
Handlers run in the workers as `tests.integration.test_exhaust_hostile:<name>`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from services.executor.backends import Launch
from services.executor.backends.local import LocalBackend
from shared.models import HandlerJob
from tests.integration.test_worker_state_hostile import one, run  # noqa: F401 (one: a fixture)

HERE = "tests.integration.test_exhaust_hostile"

# A "hopper": a process that forks a child and exits at once, the child doing the same, so
# that at any moment one or two processes exist (a bounded number: no fork bomb), but no pid
# lives longer than a fork. Bounded in time too: every generation exits once `deadline`
# (time.time()) passed or `stopfile` exists. `setsid` per generation leaves every process
# group and session at once (only what scans and kills one pid at a time can chase it).
HOPPER = """
import os, sys, time
deadline, stopfile, setsid = float(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
beats = os.open(stopfile + ".beats", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
while time.time() < deadline and not os.path.exists(stopfile):
    if os.fork():
        os._exit(0)
    if setsid:
        os.setsid()
    os.write(beats, b".")
"""


def _hopper_argv(token: str, seconds: float, stopfile: str, setsid: bool) -> list[str]:
    return [
        sys.executable,
        "-c",
        HOPPER,
        str(time.time() + seconds),
        stopfile,
        "1" if setsid else "0",
        token,  # in argv only to find its processes in /proc
    ]


def _beats(stopfile: str) -> int:
    try:
        return os.stat(stopfile + ".beats").st_size
    except FileNotFoundError:
        return 0


def hopper_lives(stopfile: str, look_s: float = 1.0) -> bool:
    """Whether the hopper still runs: each generation adds a byte to its beats file."""
    before = _beats(stopfile)
    time.sleep(look_s)
    return _beats(stopfile) > before


def stop_hopper(stopfile: str) -> None:
    """Every generation exits once the stop file exists."""
    Path(stopfile).touch()
    time.sleep(0.1)
    assert not hopper_lives(stopfile, 0.5), "the hopper would not stop"


# --- handlers (run in the workers) -------------------------------------------------------------


def start_hopper(token: str, seconds: float, stopfile: str, setsid: bool) -> str:
    """Start a hopper and return at once."""
    subprocess.Popen(_hopper_argv(token, seconds, stopfile, setsid))
    time.sleep(0.2)
    return "ok"


def leak_fds(keep_free: int) -> int:
    """Open descriptors (raw, no Python object owns them) until `keep_free` are left."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    n = 0
    have = len(os.listdir("/proc/self/fd"))
    try:
        while have + n < soft - keep_free:
            os.open(os.devnull, os.O_RDONLY)
            n += 1
    except OSError:
        pass
    return n


def open_files(n: int) -> int:
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]
    for fd in held:
        os.close(fd)
    return len(held)


def pin_to_one_cpu() -> list[int]:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    return sorted(os.sched_getaffinity(0))


def cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def go_idle_class() -> int:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return os.sched_getscheduler(0)


def sched_policy() -> int:
    return os.sched_getscheduler(0)


def set_tz(tz: str) -> str:
    os.environ["TZ"] = tz
    time.tzset()
    return time.strftime("%Z")


def tz_name() -> list[Any]:
    return [os.environ.get("TZ"), time.tzname[0], time.timezone]


def my_pid() -> int:
    return os.getpid()


# --- helpers -----------------------------------------------------------------------------------


def handler(name: str, args: Any = None, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}", args=args), timeout_s)


@pytest.fixture
def hopper(tmp_path: Path) -> Any:
    token = f"sked-probe-hopper-{uuid4().hex}"
    stopfile = str(tmp_path / "stop-hopper")
    yield token, stopfile
    stop_hopper(stopfile)


# --- findings ------------------------------------------------------------------------------------


async def test_a_handler_s_fork_hopper_ends_with_its_attempt(
    one: LocalBackend, hopper: Any
) -> None:
    """A handler starts a "hopper" (a process that forks and exits at once, its child doing
    the same: one or two processes at any moment, each living ~2 ms) and returns. The worker
    (a subreaper: every generation comes back to it as its child) is to kill what a job left
    before it replies (`worker._end`), but it makes 10 rounds and gives up: each round lists
    the children, then scans all of /proc (`descendants`) before sending SIGKILL to pids that
    by then have forked and exited, so no kill lands. The reply goes out anyway, the attempt
    is recorded a Success, and the hopper runs on in the worker beside the next tasks' jobs
    (and this task's retry), for as long as the worker lives. Now each leftover is killed as
    soon as it is read, before the scan, for up to jobstate.END_S; what still runs after that
    retires the worker, whose exit has its shim kill (freezing first) the whole tree."""
    token, stopfile = hopper
    outcome = await run(one, handler("start_hopper", [token, 20.0, stopfile, False]))
    assert outcome.ok, outcome.error
    assert not hopper_lives(stopfile), "the handler's hopper runs on after its attempt ended"
    nxt = await run(one, handler("my_pid"))
    assert nxt.ok, nxt.error
    assert not hopper_lives(stopfile), "the hopper runs on beside another task's job"


async def test_descriptors_a_handler_leaked_do_not_fail_the_next_task_s_job(
    one: LocalBackend,
) -> None:
    """Task A's handler leaks file descriptors (raw os.open without close, as a C library or a
    careless handler does) until 50 are left below RLIMIT_NOFILE, and succeeds. The worker
    checks limits, cwd, umask, niceness, signals and the environment after each job
    (jobstate.py), but not its descriptor table: task B, next in the same worker, fails
    "OSError: [Errno 24] Too many open files" opening 200 files — another task's attempt
    failed (a retry spent) for what A did, as the lowered RLIMIT_NOFILE once made it. Now
    descriptors open past half the limit (seen by one fcntl a job) retire the worker."""
    a = await run(one, handler("leak_fds", [50]), limit=60)
    assert a.ok, a.error
    b = await run(one, handler("open_files", [200]))
    assert b.ok, f"task B failed for task A's leaked descriptors: {b.error}"


async def test_a_handler_s_cpu_affinity_is_not_the_next_task_s(one: LocalBackend) -> None:
    """Task A's handler pins its process to one CPU (sched_setaffinity, as numeric code does)
    and succeeds. The worker puts back its niceness after each job (jobstate.restore) but
    not its CPU affinity: task B, next in that worker, and every subprocess it starts, run
    on A's one CPU, for the worker's life. Now the affinity is put back after each job (or
    the worker retired)."""
    before = (await run(one, handler("cpus"))).result
    assert len(before) > 1, "needs a machine with two CPUs or more"
    a = await run(one, handler("pin_to_one_cpu"))
    assert a.ok, a.error
    b = await run(one, handler("cpus"))
    assert b.result == before, f"task B runs pinned to task A's CPUs {b.result} (was {before})"


async def test_a_handler_s_scheduling_class_is_not_the_next_task_s(one: LocalBackend) -> None:
    """Task A's handler moves its process to SCHED_IDLE (a background job being polite) and
    succeeds. The niceness is put back after each job, the scheduling policy is not: task B,
    next in that worker, runs as SCHED_IDLE (policy 5) — starved by any other load on the
    node, and past its timeout for nothing it did. Now the policy is put back after each job
    (or the worker retired)."""
    before = (await run(one, handler("sched_policy"))).result
    a = await run(one, handler("go_idle_class"))
    assert a.ok, a.error
    b = await run(one, handler("sched_policy"))
    assert b.result == before, f"task B runs in task A's scheduling class {b.result}"


async def test_a_handler_s_time_zone_is_not_the_next_task_s(one: LocalBackend) -> None:
    """Task A's handler sets TZ=Asia/Tokyo in os.environ and calls time.tzset(). The worker
    puts the environment back after the job (TZ unset again) but not the C library's zone
    that tzset() loaded from it: task B, next in that worker, sees no TZ in its environment
    yet gets localtime() in JST (time.timezone -32400): its timestamps are nine hours off.
    Now a zone that changed is loaded again (time.tzset()) once the environment is back."""
    before = (await run(one, handler("tz_name"))).result
    a = await run(one, handler("set_tz", ["Asia/Tokyo"]))
    assert a.ok, a.error
    b = await run(one, handler("tz_name"))
    assert b.result == before, f"task B sees task A's time zone {b.result} (was {before})"
