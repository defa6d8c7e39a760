"""A handler worker (`python -m services.executor.worker OUT_FILE`): runs one job at a time.

Reads one JSON job per line on stdin, {"job", "handler", "args", "env"}, and answers each with
one JSON line on stdout naming the job, {"job": ..., "ok": true, "result": ...} or {"job": ...,
"ok": false, "error": ..., "traceback": ...}.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable, MutableMapping
from typing import Any, BinaryIO

READY = b'{"ready": true}\n'
# Replies are single lines; the backend's line reader is sized to this.
MAX_REPLY_BYTES = 16 * 1024 * 1024


def describe(exc: BaseException) -> str:
    """`ValueError: bad`, on one line."""
    text = " ".join(str(exc).split())
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
    which holds the output of the current job only."""

    def __init__(self, out_path: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        self.out = os.open(out_path, flags, 0o644)
        # The job and reply channels move to private descriptors, and fds 0 and 1 to /dev/null,
        # so nothing a handler reads or prints can swallow a job or corrupt a reply. os.dup makes
        # non-inheritable descriptors: the handler's subprocesses do not hold the channels open.
        self.jobs: BinaryIO = os.fdopen(os.dup(0), "rb")
        self.replies: BinaryIO = os.fdopen(os.dup(1), "wb")
        self.quiet = os.open(os.devnull, os.O_RDWR)
        self.stderr = os.dup(2)
        os.dup2(self.quiet, 0)
        os.dup2(self.quiet, 1)
        # Line buffering, so what a handler printed survives its worker being killed mid-job.
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        self.handlers: dict[str, Callable[..., Any]] = {}
        self.env = JobEnv(os.environ)

    def serve(self) -> None:
        self.replies.write(READY)
        self.replies.flush()
        for line in self.jobs:
            self.replies.write(self.run(json.loads(line)))
            self.replies.flush()

    def resolve(self, path: str) -> Callable[..., Any]:
        found = self.handlers.get(path)
        if found is None:
            module, _, name = path.rpartition(":" if ":" in path else ".")
            found = getattr(importlib.import_module(module), name)
            if not callable(found):
                raise TypeError(f"{path} is not callable")
            self.handlers[path] = found
        return found

    def run(self, job: dict[str, Any]) -> bytes:
        """Run one job with its output going to the out file; return the reply line."""
        os.ftruncate(self.out, 0)  # O_APPEND: the next write lands at the start again
        self.env.use(job.get("env") or {})
        os.dup2(self.out, 1)
        os.dup2(self.out, 2)
        try:
            reply = self._call(job["handler"], job.get("args"), job.get("inputs"))
            # the job's id first: a line naming another job is not this job's reply
            return b'{"job":' + json.dumps(job.get("job")).encode() + b"," + reply[1:]
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):  # the handler closed it
                    stream.flush()
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            os.dup2(self.quiet, 1)
            os.dup2(self.stderr, 2)

    def _call(self, path: str, args: Any, inputs: Any = None) -> bytes:
        try:
            handler = self.resolve(path)
        except BaseException as exc:
            return _failure(f"could not import {path!r}: {describe(exc)}")
        try:
            # a workflow task's upstream outputs, for a handler that asks for them by name
            extra = {"inputs": inputs} if inputs is not None and _takes_inputs(handler) else {}
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
            return _failure(describe(exc))
        try:
            reply = json.dumps({"ok": True, "result": result}, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            return _failure(f"result is not JSON: {describe(exc)}", show=False)
        if len(reply) >= MAX_REPLY_BYTES:
            return _failure(f"result too large: {len(reply)} bytes of JSON", show=False)
        return reply + b"\n"


@functools.cache
def _takes_inputs(handler: Callable[..., Any]) -> bool:
    """Whether `handler` has a parameter named `inputs` (asked by name: a **kwargs catch-all
    does not count, so a handler never gets an argument it did not name)."""
    try:
        params = inspect.signature(handler).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(
        p.name == "inputs" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params
    )


def _failure(error: str, *, show: bool = True) -> bytes:
    """The reply for a failed job; the traceback also goes to the job's log (stderr)."""
    trace = traceback.format_exc() if show else ""
    if trace:
        sys.stderr.write(trace)
    reply = {"ok": False, "error": error[:2000], "traceback": trace[-MAX_REPLY_BYTES // 2 :]}
    return json.dumps(reply).encode() + b"\n"


def main() -> None:
    # Handlers import as they would in the executor: from its working directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    Worker(sys.argv[1]).serve()


if __name__ == "__main__":
    main()
