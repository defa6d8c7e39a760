"""What a handler job may leave changed in its worker's process, and the check after each job
that puts it back. Jobs of different tasks share a worker (one after another, or queued behind
one another), so a job that ignored SIGCHLD made the next task's `subprocess.run(["false"])`
return 0, a timer it left armed fired inside the next job, and a lowered RLIMIT_NOFILE, a
`chdir` into a directory it then removed, a umask of 0o777, a closed `sys.stdout` or an
edited `os.environ` were the next task's. A command attempt gets a fresh process; a handler
job gets what the worker had when it started: each is checked after every job (a few
reads: /proc/self/status and /proc/self/limits, the timers, the working directory, the umask,
the niceness, the CPU affinity and scheduling policy, the environment and the time zone loaded
from it) and put back where it changed. What cannot be put back (a hard limit lowered, a
niceness raised without the privilege to lower it), and descriptors jobs left open past half
the limit (a C library's leak, say, which failed a later task's open()), retire the worker:
its reply says so, it exits, and the pool replaces it (WorkerPool.release).

The environment below os.environ (os.putenv, a C library's setenv: what exec() passes on) is
put back as os.environ has it. Python-level state (a module's globals, monkeypatching,
threads) is beyond this: handlers of different tasks share an interpreter, as Celery's do;
isolation between them is a command's.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import resource
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from services.executor.warden.proctree import descendants, signal_

END_S = 2.0  # how long what a job left running is chased before its worker is retired for it
_NULL = bytes(8)  # the pointer that ends the C environment's array
_TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
_LIMITS = [getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")]


try:  # the C library's environment, which exec() passes on to what a job starts
    _LIBC = ctypes.CDLL(None)
    _ENVIRON: ctypes.c_void_p | None = ctypes.c_void_p.in_dll(_LIBC, "environ")
except (OSError, ValueError, AttributeError):
    _ENVIRON = None
_ODD = b"="  # (no variable's name) stands for entries no unsetenv can name: "=x", a bare "X"


class ProcessState:
    """The worker's process-wide state as it stood when it took its first job."""

    def __init__(self) -> None:
        self._status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        self._limits_fd = os.open("/proc/self/limits", os.O_RDONLY | os.O_CLOEXEC)
        self._env_at: int | None = None  # the C environment's array, as last marked
        self._env_n = 0  # its variables then
        self._env_mark: bytes | None = None  # its pointers then
        self.retake({}, {})

    def retake(self, job_env: Mapping[str, str], before: Mapping[str, str | None]) -> None:
        """Take the process as it is now for what each job gets: at the start, and after a
        handler's module was imported (what its import set up is the worker's, not undone
        after its first job); `job_env` is set now over `before`, and is not the worker's."""
        self.signals = self._signals()
        self.handlers = {s: signal.getsignal(s) for s in _catchable()}
        # Python handlers on signals caught already: swapped for another, the masks are alike
        self.python = {s: h for s, h in self.handlers.items() if callable(h)}
        self.blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self.limits_text = os.pread(self._limits_fd, 1 << 14, 0)
        self.limits = {r: resource.getrlimit(r) for r in _LIMITS}
        self.cwd = os.getcwd()
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.cpus = os.sched_getaffinity(0)
        self.policy = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)
        self.zone = _zone()
        # A descriptor this high in use means jobs left many open (the lowest free number is
        # always the one taken): they are counted then. One fcntl a job, not a listing.
        soft = self.limits.get(resource.RLIMIT_NOFILE, (1024, 0))[0]
        self.fd_mark = max(64, min(soft if soft > 0 else 1 << 20, 1 << 20) // 2)
        self.environ: dict[bytes, bytes] = dict(_data())
        for name in job_env:
            value = before.get(name)
            if value is None:
                self.environ.pop(os.fsencode(name), None)
            else:
                self.environ[os.fsencode(name)] = os.fsencode(value)

    def signals_back(self) -> set[int]:
        """Right after the job returns, before anything else runs: its timers disarmed and
        the worker's signal dispositions and mask put back. A signal that came while the job
        blocked it, and that the worker's mask lets through, is taken off first: unblocked, its
        default action would kill the worker before the job's reply. Returns those taken off
        (a nudge among them is the worker's to answer)."""
        for timer in _TIMERS:  # one could fire inside what follows, or the next job
            if signal.getitimer(timer) != (0.0, 0.0):
                signal.setitimer(timer, 0)
        if self._signals() == self.signals and all(
            signal.getsignal(s) is h for s, h in self.python.items()
        ):
            return set()
        taken: set[int] = set()
        while waiting := signal.sigpending() - self.blocked:
            got = signal.sigtimedwait(waiting, 0)
            if got is None:
                break
            taken.add(got.si_signo)
        for sig, handler in self.handlers.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.blocked)
        return taken

    def restore(self, job_env: Mapping[str, str]) -> str | None:
        """Put back the rest of what the job changed (after `signals_back`). None, or what
        could not be put back (the worker must be retired)."""
        lost: list[str] = []
        if os.pread(self._limits_fd, 1 << 14, 0) != self.limits_text:
            for which, (soft, hard) in self.limits.items():
                try:
                    if resource.getrlimit(which) != (soft, hard):
                        resource.setrlimit(which, (soft, hard))
                except (OSError, ValueError) as exc:
                    lost.append(f"a resource limit ({exc})")
                    break
        try:
            if _cwd() != self.cwd:
                os.chdir(self.cwd)
        except OSError as exc:  # the worker's own directory removed: relative imports fail
            lost.append(f"its working directory ({exc})")
        os.umask(self.umask)  # one call, whatever the job left
        if os.getpriority(os.PRIO_PROCESS, 0) != self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, self.nice)
            except OSError as exc:
                lost.append(f"its niceness ({exc})")
        if os.sched_getaffinity(0) != self.cpus:
            try:
                os.sched_setaffinity(0, self.cpus)
            except OSError as exc:
                lost.append(f"its CPU affinity ({exc})")
        if (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority) != self.policy:
            try:
                os.sched_setscheduler(0, self.policy[0], os.sched_param(self.policy[1]))
            except OSError as exc:
                lost.append(f"its scheduling policy ({exc})")
        self._put_back_environ(job_env)
        if why := self._c_env_back():
            lost.append(why)
        if _zone() != self.zone:  # a time.tzset() the job made: its TZ is put back above
            time.tzset()
        if _open(self.fd_mark) and len(os.listdir("/proc/self/fd")) > self.fd_mark:
            lost.append(f"over {self.fd_mark} open file descriptors (left by jobs)")
        _reopen_streams()
        return "; ".join(lost) or None

    def mark_env(self) -> None:
        """The C environment as the job is given it (after JobEnv.use): `restore` compares.
        Only its array of pointers is read (~1.5 µs): a variable set or unset below os.environ
        (os.putenv, a C library's setenv, clearenv) changes a slot, the array or its length."""
        if _ENVIRON is None:
            return
        where = _ENVIRON.value or 0
        if where and where == self._env_at:
            mark = ctypes.string_at(where, 8 * (self._env_n + 1))
            if mark.endswith(_NULL):  # (an array grown in place past the count has no NULL)
                self._env_mark = mark
                return
        self._env_at, self._env_n = where, _count(where)
        self._env_mark = ctypes.string_at(where, 8 * (self._env_n + 1)) if where else b""

    def _c_env_back(self) -> str | None:
        """What the job set or unset below os.environ, put back as os.environ has it (a job's
        os.putenv("LD_PRELOAD", ...) was every later job's subprocesses', and its clearenv()
        left them no PATH). None, or why it could not be (the worker must be retired)."""
        if _ENVIRON is None or self._env_mark is None:
            return None
        where = _ENVIRON.value or 0
        if where == self._env_at and (
            not where or ctypes.string_at(where, 8 * (self._env_n + 1)) == self._env_mark
        ):
            return None
        if len(os.listdir("/proc/self/task")) > 1:
            # a thread a job left may set variables meanwhile: the array it reallocates (and
            # frees) under a walk of its strings would crash the worker
            return "its C environment, with threads running"
        python, found = os.environb, _c_environ()
        if _ODD in found:  # emptied and built again from os.environ
            _LIBC.clearenv()
            found = {}
        for key in [k for k, v in found.items() if v is None or k not in python]:
            with contextlib.suppress(OSError, ValueError):
                os.unsetenv(key)  # every entry of the name (a duplicate: exec passes both)
            found.pop(key)
        for key, value in python.items():
            if found.get(key) != value:
                with contextlib.suppress(OSError, ValueError):
                    os.putenv(key, value)
        return None

    def _signals(self) -> bytes:
        """Its blocked, ignored and caught signals, real-time ones too (/proc/self/stat's
        fields hold only 1-31): the SigBlk, SigIgn and SigCgt lines of /proc/self/status."""
        status = os.pread(self._status, 1 << 14, 0)
        start = status.find(b"SigBlk:")
        return status[start : status.find(b"\n", status.find(b"SigCgt:", start))]

    def _put_back_environ(self, job_env: Mapping[str, str]) -> None:
        """The environment the worker started with and the job's own variables (JobEnv)."""
        expected = self.environ.copy()
        for name, text in job_env.items():
            expected[os.fsencode(name)] = os.fsencode(text)
        data = _data()
        if data == expected:
            return
        environ = os.environb
        for key in [k for k in data if k not in expected]:
            del environ[key]
        for key, value in expected.items():
            if data.get(key) != value:
                environ[key] = value


def _zone() -> tuple[Any, ...]:
    return (time.timezone, time.altzone, time.daylight, time.tzname)


def _open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


def _count(where: int) -> int:
    """How many variables the C environment's array at `where` holds (its pointers only)."""
    if not where:
        return 0
    slots = ctypes.cast(where, ctypes.POINTER(ctypes.c_void_p))
    n = 0
    while slots[n]:
        n += 1
    return n


def _c_environ() -> dict[bytes, bytes | None]:
    """The C environment's variables, read through its array of pointers; None for a name
    that is there twice (getenv finds the first, a shell takes the last)."""
    found: dict[bytes, bytes | None] = {}
    if _ENVIRON is None or not _ENVIRON.value:
        return found
    entries = ctypes.cast(_ENVIRON.value, ctypes.POINTER(ctypes.c_char_p))
    i = 0
    while (entry := entries[i]) is not None:
        key, sep, value = entry.partition(b"=")
        if not (key and sep):
            key = _ODD
        found[key] = None if key in found else value
        i += 1
    return found


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except FileNotFoundError:  # the job removed the directory it moved to
        return None


def _catchable() -> list[int]:
    return [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


def _data() -> dict[bytes, bytes]:
    """os.environ's own bytes mapping, compared without a copy of each entry."""
    data: Any = getattr(os.environ, "_data", None)
    return data if isinstance(data, dict) else dict(os.environb)


def _reopen_streams() -> None:
    """A job that closed sys.stdout or sys.stderr closed the worker's: every later job's print
    failed. Opened again on fds 1 and 2 (the worker points those at each job's output)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, f"__{name}__")
        if stream is None or stream.closed:
            fresh = open(fd, "w", buffering=1, closefd=False)  # noqa: SIM115 (line buffered)
            setattr(sys, f"__{name}__", fresh)
            setattr(sys, name, fresh)


def leftovers() -> list[int]:
    """The worker's children: what the job that ended left running, or left once their
    parents ended (the worker is their subreaper). None (most jobs): one system call."""
    try:
        os.waitpid(-1, os.WNOHANG)  # reaps one that ended, if any: it was the job's
    except ChildProcessError:
        return []
    me = os.getpid()
    # every thread's: one `threading` does not count (a C extension's) may have started it
    tids = os.listdir(f"/proc/{me}/task")
    found: list[int] = []
    for tid in tids:
        try:  # os.open and read, not open(): a third of the cost
            fd = os.open(f"/proc/{me}/task/{tid}/children", os.O_RDONLY)
        except OSError:
            continue
        with contextlib.suppress(OSError, ValueError):
            found += [int(pid) for pid in os.read(fd, 1 << 16).split()]
        os.close(fd)
    return found


def end(children: list[int]) -> bool:
    """Kill what a job left, each child's whole tree, and reap them: a handler's processes end
    with its attempt, as a command's do. Again while any is left, for up to END_S: one may
    fork meanwhile. Each child is killed as soon as it is read, before the scan of /proc for
    its descendants: a process that forks and exits at once had, by the scan's end, forked
    again every round (ten rounds, then the job's reply went out with it running). False if
    some would not end."""
    deadline = time.monotonic() + END_S
    while True:
        for pid in children:
            signal_(pid, signal.SIGKILL)
        for pid in descendants(*children):
            signal_(pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)
        if not (children := leftovers()):
            return True
        if time.monotonic() > deadline:
            return False
