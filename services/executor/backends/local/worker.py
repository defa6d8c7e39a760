"""A handler worker (`python -m services.executor.worker OUT_FILE`): runs jobs one at a time, in
the order they came.

Reads one JSON job per line, {"job", "handler", "args", "env", "inputs"?, "log"?}, and answers
each with one JSON line naming the job, {"job": ..., "ok": true, "result": ...} or {"job": ...,
"ok": false, "error": ..., "traceback": ...} (with "log": true when its output was moved to the
job's "log" path) and how long it ran ("ran", seconds). Jobs that arrive while one runs wait
here, in order: a worker that finds its next job waiting runs it without sleeping, which is
what a burst of short jobs saves. Each reply is written before the next job starts, so that
when a worker dies, the first job without a reply is the one it was running and those after it
never started. SIGUSR1 (a nudge, sent through the worker's shim) gives back every job not yet
started, {"returned": [job, ...]}; a job taken from the queue is started, never given back. A
job that changed the process past putting back (jobstate.py) has "retire" in its reply, and the
worker exits right after writing it: the jobs waiting behind never start here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import json
import os
import select
import shutil
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, MutableMapping
from types import FrameType
from typing import Any

from pydantic_core import from_json

from services.executor.backends.local.calls import may_be_unreadable, readable, takes_inputs
from services.executor.backends.local.jobstate import ProcessState, end, leftovers
from services.executor.warden.proctree import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_DUMPABLE,
    prctl,
)
from shared import jsonvalue

READY = b'{"ready": true}\n'
# Replies are single lines; the backend's line reader is sized to this. A success carries a
# result of at most MAX_RESULT_BYTES once cleaned (twice that before: each NUL halves as it is
# escaped), a failure at most MAX_TRACE_CHARS of traceback (12 bytes a character at most).
MAX_REPLY_BYTES = 4 * 1024 * 1024
MAX_TRACE_CHARS = 64 * 1024
_SUCCESS = len(b'{"ok": true, "result": }')  # a success reply's bytes around its result
READ_SIZE = 1 << 20
NUDGE = signal.SIGUSR1
IO, WAIT, RUN = "io", "wait", "run"  # what the loop is doing when a nudge comes


def describe(exc: BaseException) -> str:
    """`ValueError: bad`, on one line; never raises (a handler's exception may not be able
    to say what it is)."""
    try:
        text = " ".join(str(exc).split())
    except Exception:
        text = "(its message could not be read)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class JobEnv:
    """The variables of the job at hand in a worker's environment (`os.environ`)."""

    def __init__(self, environ: MutableMapping[str, str]) -> None:
        self.environ = environ
        self.job: dict[str, str] = {}  # the variables the current (or last) job set
        self.before: dict[str, str | None] = {}  # their values before any job set them

    def use(self, env: dict[str, str]) -> None:
        """Set this job's variables, and put back as they were before any job those of the
        last job that this one does not set. A variable already at its value is not set again:
        glibc's setenv keeps a copy of every value it is given, for the process's life, and
        most of a job's variables (its heartbeat URL, attempt 1) are the last job's."""
        environ = self.environ
        for key in self.job.keys() - env.keys():
            value = self.before.pop(key)
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value
        for key, value in env.items():
            current = environ.get(key)
            if key not in self.before:
                self.before[key] = current
            if current != value:
                environ[key] = value
        self.job = env


class Worker:
    """Runs jobs with the handler's output (Python, C level, subprocesses) sent to `out_path`,
    which holds the output of the current job only: a job that printed anything has it moved
    to its "log" path afterwards, and the next gets a fresh file."""

    def __init__(self, out_path: str) -> None:
        self.out_path = out_path
        self.pid = os.getpid()  # a handler's fork returning into this code is not the worker
        self.out = self._open_out()
        # The job and reply channels move to private descriptors, and fds 0 and 1 to /dev/null,
        # so nothing a handler reads or prints can swallow a job or corrupt a reply. os.dup makes
        # non-inheritable descriptors: the handler's subprocesses do not hold the channels open.
        self.jobs = os.dup(0)
        self.replies = os.dup(1)
        self.quiet = os.open(os.devnull, os.O_RDWR)
        self.stderr = os.dup(2)
        os.dup2(self.quiet, 0)
        os.dup2(self.quiet, 1)
        # Line buffering, so what a handler printed survives its worker being killed mid-job.
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        self.handlers: dict[str, Callable[..., Any]] = {}
        self.env = JobEnv(os.environ)
        self.queue: deque[bytes] = deque()  # whole job lines, not started
        self.partial = bytearray()  # the start of a line whose end has not come yet
        # A nudge gives back what waits. It may come between any two bytecodes: while the
        # loop below reads, parses, takes a job or writes (IO) it is noted and answered when
        # that ends; while a job runs (RUN), or while the loop waits in poll() holding no data
        # it has not parsed (WAIT), at once.
        self.mode = IO
        self.nudged = False
        self.giving = False
        self.retiring = False  # a job changed what could not be put back: exit after its reply
        os.set_blocking(self.jobs, False)
        self.poller = select.poll()
        self.poller.register(self.jobs, select.POLLIN)

    def _open_out(self) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        return os.open(self.out_path, flags, 0o600)

    def serve(self) -> None:
        signal.signal(NUDGE, self._on_nudge)
        self.state = ProcessState()  # what each job finds, and gets back after it
        self._write(READY)
        while not self.retiring:  # (after a job changed this process for good: nothing more)
            if not self.queue:
                self.mode = WAIT
                if self.nudged:
                    self._give_back()
                self.poller.poll()  # retried after a signal (PEP 475)
                self.mode = IO
                try:
                    data = os.read(self.jobs, READ_SIZE)
                except BlockingIOError:
                    continue  # a nudge took it, or nothing came
                if not data:
                    return  # the executor closed the pipe
                self._take_in(data)
                continue
            line = self.queue.popleft()  # started: never given back from here on
            self.mode = RUN
            if self.nudged:
                self._give_back()
            reply = self.run(line, time.monotonic())
            if signal.getsignal(NUDGE) != self._on_nudge:  # a handler took the signal over
                signal.signal(NUDGE, self._on_nudge)
            self.mode = IO
            self._write(reply)
        # Gone at once: an interpreter's exit waits for its non-daemon threads and atexit
        # hooks (a handler module's flusher), and the jobs behind come back only when it ends.
        os._exit(0)

    def _take_in(self, data: bytes) -> None:
        buffer = self.partial
        buffer += data
        end = buffer.find(b"\n")
        start = 0
        while end >= 0:
            self.queue.append(bytes(buffer[start : end + 1]))
            start = end + 1
            end = buffer.find(b"\n", start)
        del buffer[:start]

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.replies, view) :]

    def _on_nudge(self, _sig: int, _frame: FrameType | None) -> None:
        if self.mode == IO or self.giving:
            self.nudged = True
        else:
            self._give_back()

    def _give_back(self) -> None:
        """Answer a nudge: the jobs not started, taken back."""
        self.giving = True
        try:
            self.nudged = False
            with contextlib.suppress(BlockingIOError):  # what the executor wrote before
                while data := os.read(self.jobs, READ_SIZE):
                    self._take_in(data)
            returned = []
            for line in self.queue:
                with contextlib.suppress(ValueError, AttributeError):
                    returned.append(json.loads(line).get("job"))
            self.queue.clear()
            self._write(json.dumps({"returned": returned}).encode() + b"\n")
        finally:
            self.giving = False

    def resolve(self, path: str) -> Callable[..., Any]:
        found = self.handlers.get(path)
        if found is None:
            module, _, name = path.rpartition(":" if ":" in path else ".")
            found = getattr(importlib.import_module(module), name)
            if not callable(found):
                raise TypeError(f"{path} is not callable")
            self.handlers[path] = found
        return found

    def run(self, line: bytes, started: float = 0.0) -> bytes:
        """Run one job, its output to the out file; its reply, with "ran" (monotonic s)."""
        try:
            job = from_json(line)  # the executor's line: pydantic's parser, 4x json.loads's speed
            stem = json.dumps(job["job"])
            handler, job_env = job["handler"], job.get("env") or {}
        except (ValueError, TypeError, KeyError, AttributeError):
            return _failure("not a job", show=False)  # names no job: the executor kills us
        if os.fstat(self.out).st_size:  # what a process an earlier job left running wrote
            # O_APPEND: the next write lands at the start again. Only when there is something
            # to cut: a truncation rewrites the file's times (an inode update the file system
            # journals); most jobs find it emptied (moved to its log) or never written.
            os.ftruncate(self.out, 0)
        os.dup2(self.out, 1)
        os.dup2(self.out, 2)
        try:
            if handler not in self.handlers:  # what its import sets up is the worker's now
                with contextlib.suppress(BaseException):  # (_call says why, resolving again)
                    self.resolve(handler)
                    self.state.retake(self.env.job, self.env.before)
            self.env.use(job_env)
            self.state.mark_env()
            reply = self._call(handler, job.get("args"), job.get("inputs"))
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):  # the handler closed it
                    stream.flush()
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            os.dup2(self.quiet, 1)
            os.dup2(self.stderr, 2)
        self._forked(None)
        if NUDGE in self.state.signals_back():  # (a nudge that came while the job blocked it)
            self._on_nudge(NUDGE, None)
        # what the job left running ends before its reply: a retry must not run beside it
        ended = end(left) if (left := leftovers()) else True
        kept = self.state.restore(job_env)  # before the next job, which may be queued here
        if not ended:  # the worker's exit ends them: its shim kills (freezing first) its tree
            kept = "; ".join(filter(None, [kept, "processes the job left would not end"]))
        ran = time.monotonic() - started if started else 0.0
        logged = self._keep_output(job.get("log"))
        # the job's id first: a line naming another job is not this job's reply
        head = b'{"job":%s,"ran":%.6f,' % (stem.encode(), ran)
        if kept is not None:  # what could not be put back: take no more jobs here
            head += b'"retire":%s,' % json.dumps(kept).encode()
            self.retiring = True
        return head + (b'"log":true,' if logged else b"") + reply[1:]

    def _forked(self, exc: BaseException | None) -> None:
        """A handler forked and its child came back here: it ends, with the status its code
        meant (only the worker replies, and reads the next job: another task's)."""
        if os.getpid() != self.pid:
            code = exc.code if isinstance(exc, SystemExit) else int(exc is not None)
            os._exit(code if isinstance(code, int) else int(code is not None))

    def _keep_output(self, log: object) -> bool:
        """Move what the job printed to its log, and start a fresh out file for the next."""
        if not isinstance(log, str) or os.fstat(self.out).st_size == 0:
            return False
        try:
            os.rename(self.out_path, log)
        except OSError:
            try:
                shutil.copyfile(self.out_path, log)
            except OSError:
                return False
        os.close(self.out)
        self.out = self._open_out()
        return True

    def _call(self, path: str, args: Any, inputs: Any = None) -> bytes:
        try:
            handler = self.resolve(path)
        except BaseException as exc:
            return _failure(f"could not import {path!r}: {describe(exc)}")
        try:
            # a workflow task's upstream outputs, for a handler that asks for them by name
            extra = {"inputs": inputs} if inputs is not None and takes_inputs(handler) else {}
            if isinstance(args, dict):
                result = handler(**args, **extra)
            elif isinstance(args, list):
                result = handler(*args, **extra)
            elif args is None:
                result = handler(**extra)
            else:
                result = handler(args, **extra)
            if inspect.iscoroutine(result):
                result = asyncio.run(result)
        except BaseException as exc:  # SystemExit too: a handler must not end its worker
            self._forked(exc)
            return _failure(describe(exc))
        try:
            reply = json.dumps({"ok": True, "result": result}, allow_nan=False).encode()
            if may_be_unreadable(reply) and not readable(reply):
                # a lone surrogate's escape, or nesting past what the executor's parser
                # takes: escaped as the executor would (outcome.storable), or refused
                cleaned = jsonvalue.clean(result)
                reply = json.dumps({"ok": True, "result": cleaned}, allow_nan=False).encode()
        except Exception as exc:  # a result's own methods may raise anything, or recurse
            return _failure(f"result is not JSON: {describe(exc)}", show=False)
        # judged here, by the reply's bytes, as the executor would judge it (outcome.storable):
        # refused at once, it never crosses the pipe nor is parsed and walked there
        size = jsonvalue.cleaned_size_floor(reply) - _SUCCESS
        if size > jsonvalue.MAX_RESULT_BYTES or len(reply) >= MAX_REPLY_BYTES:
            limit = jsonvalue.MAX_RESULT_BYTES
            why = f"result too large: {size} bytes of JSON, over the limit of {limit}"
            return _failure(why, show=False)
        return reply + b"\n"


@functools.cache
def _failure(error: str, *, show: bool = True) -> bytes:
    """The reply for a failed job; the traceback also goes to the job's log (stderr). Lone
    surrogates (an exception's text may hold them) are written as their escapes' text."""
    try:
        trace = traceback.format_exc() if show else ""
    except Exception:  # a frame's or an exception's own text that will not format
        trace = ""
    error, trace = _escaped(error[:2000]), _escaped(trace)
    if trace:
        with contextlib.suppress(OSError, ValueError):  # the handler closed it
            sys.stderr.write(trace)
    # cut by characters, each at most 12 bytes of JSON (a surrogate pair's escapes): the reply
    # always fits its line, whatever the exception's text holds
    shown = trace[-MAX_TRACE_CHARS:]
    return json.dumps({"ok": False, "error": error, "traceback": shown}).encode() + b"\n"


def _escaped(text: str) -> str:
    """`text` with each lone surrogate written as the text of its escape (`\\udc80`)."""
    return text.encode("utf-8", "backslashreplace").decode()


def main() -> None:
    # Closed to the other processes of our user (see the warden's serve): a task's process
    # could else open this worker's pipes through /proc/<pid>/fd and forge the replies of
    # other tasks' jobs, or read and inject jobs. Jobs that share a worker share a process.
    prctl(PR_SET_DUMPABLE, 0)
    # what a job's processes leave when their parents end comes back here, to be ended too
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    # Handlers import as they would in the executor: from its working directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    Worker(sys.argv[1]).serve()


if __name__ == "__main__":
    main()
