"""What a handler job may leave changed in its worker's process, and the check after each job
that puts it back. Jobs of different tasks share a worker (one after another, or queued behind
one another), so a job that ignored SIGCHLD made the next task's `subprocess.run(["false"])`
return 0, a timer it left armed fired inside the next job, and a lowered RLIMIT_NOFILE, a
`chdir` into a directory it then removed, a umask of 0o777, a closed `sys.stdout` or an
edited `os.environ` were the next task's. A command attempt gets a fresh process; a handler
job gets what the worker had when it started: each is checked after every job (a few
reads: /proc/self/stat and /proc/self/limits, the timers, the working directory, the umask,
the niceness, the environment) and put back where it changed. What cannot be put back (a
hard limit lowered, a niceness raised without the privilege to lower it) retires the worker:
its reply says so, and the pool replaces it (WorkerPool.release).

Python-level state (a module's globals, monkeypatching, threads) is beyond this: handlers of
different tasks share an interpreter, as Celery's do; isolation between them is a command's.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
from collections.abc import Mapping
from typing import Any

_TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
_LIMITS = [getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")]


class ProcessState:
    """The worker's process-wide state as it stood when it took its first job."""

    def __init__(self) -> None:
        self._stat = os.open("/proc/self/stat", os.O_RDONLY | os.O_CLOEXEC)
        self._limits_fd = os.open("/proc/self/limits", os.O_RDONLY | os.O_CLOEXEC)
        self.signals = self._signals()
        self.handlers = {s: signal.getsignal(s) for s in _catchable()}
        self.blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self.limits_text = os.pread(self._limits_fd, 1 << 14, 0)
        self.limits = {r: resource.getrlimit(r) for r in _LIMITS}
        self.cwd = os.getcwd()
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.environ: dict[bytes, bytes] = dict(_data())

    def restore(self, job_env: Mapping[str, str]) -> str | None:
        """Put back what the job changed. None, or what could not be put back (the worker
        must be retired)."""
        for timer in _TIMERS:  # disarmed first: one could fire inside the next job
            if signal.getitimer(timer) != (0.0, 0.0):
                signal.setitimer(timer, 0)
        lost: list[str] = []
        if self._signals() != self.signals:
            self._put_back_signals()
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
        self._put_back_environ(job_env)
        _reopen_streams()
        return "; ".join(lost) or None

    def _signals(self) -> list[bytes]:
        """Its blocked, ignored and caught signals (fields 32-34 of /proc/self/stat: half
        the cost of /proc/self/status, which the kernel fills with much more)."""
        stat = os.pread(self._stat, 4096, 0)
        return stat[stat.rindex(b")") :].split()[30:33]

    def _put_back_signals(self) -> None:
        for sig, handler in self.handlers.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.blocked)

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
