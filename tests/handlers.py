"""Handler functions the backend tests run in handler workers, as `tests.handlers:<name>`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any


def noop() -> None:
    return None


def echo(**kwargs: Any) -> dict[str, Any]:
    print("echo", sorted(kwargs))  # noqa: T201
    return kwargs


def add(a: int, b: int) -> int:
    return a + b


def double(x: float) -> float:
    return x * 2


async def slow_add(a: int, b: int) -> int:
    await asyncio.sleep(0.01)
    return a + b


def fail() -> None:
    print("about to fail")  # noqa: T201
    raise ValueError("bad")


def not_json() -> set[int]:
    return {1, 2}


def exit_now(code: int) -> None:
    print("bye", flush=True)  # noqa: T201
    os._exit(code)


def pid() -> int:
    return os.getpid()


def environ(name: str) -> str | None:
    return os.environ.get(name)


def sleep(seconds: float, marker: str | None = None) -> str:
    """Print, touch `marker` (so a test knows it runs), then sleep."""
    print("sleeping", flush=True)  # noqa: T201
    sys.stderr.write("to stderr\n")
    if marker:
        open(marker, "w").close()
    time.sleep(seconds)
    return "woke"


def leave_writer(after_s: float, text: str, marker: str) -> None:
    """Leave behind a process that prints `text` to the job's output after `after_s`, once
    this job has ended, and then touches `marker` (so a test knows it was written)."""
    script = 'sleep "$0"; echo "$1"; touch "$2"'  # values as arguments, never as shell text
    subprocess.Popen(["sh", "-c", script, str(after_s), text, marker])


def spawn_sleeper(pidfile: str) -> None:
    """Start a grandchild `sleep 60` in the worker's process group, then wait forever."""
    child = subprocess.Popen(["sleep", "60"])
    with open(pidfile + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.replace(pidfile + ".tmp", pidfile)
    time.sleep(3600)


def total(inputs: dict[str, Any], base: float = 0) -> float:
    """Sum the numbers its upstreams handed down (a workflow task's `inputs`)."""
    return base + sum(v for v in inputs.values() if isinstance(v, int | float))


def emit(value: Any) -> Any:
    return value


def sees_inputs(inputs: Any = None) -> Any:
    return {"inputs": inputs}


def whole_environ() -> dict[str, str]:
    """Everything in the handler's environment (the secrets test reads it)."""
    return dict(os.environ)


def reply_later(after_s: float, line: str) -> str:
    """Returns at once, leaving a thread that writes `line` to every pipe the worker process
    holds open for writing `after_s` later: the reply channel among them, in the next job."""
    import fcntl
    import threading

    def forge() -> None:
        time.sleep(after_s)
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                pipe = os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
                writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY
                if pipe and writable and fd > 2:
                    os.write(fd, line.encode() + b"\n")
            except OSError:
                pass

    threading.Thread(target=forge, daemon=True).start()
    return "mine"


def touch(path: str) -> None:
    open(path, "w").close()


def sleep_pid(seconds: float, marker: str | None = None) -> int:
    """Touch `marker`, sleep, then say which worker ran it."""
    if marker:
        open(marker, "w").close()
    time.sleep(seconds)
    return os.getpid()


def deaf_sleep(seconds: float, marker: str) -> int:
    """Ignore the worker's nudges (SIGUSR1), touch `marker`, sleep; say which worker ran it."""
    import signal

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    open(marker, "w").close()
    time.sleep(seconds)
    return os.getpid()


def count(path: str) -> int:
    """Append a line to `path`; return this worker's pid (how often a job ran: the lines)."""
    with open(path, "a") as f:
        f.write("ran\n")
    return os.getpid()


def forge_returned(stem: str) -> None:
    """Write, as the worker would, an answer to a nudge nobody sent, naming job `stem`."""
    import json as json_

    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:") and int(fd) > 2:
                os.write(int(fd), json_.dumps({"returned": [stem]}).encode() + b"\n")
        except OSError:
            continue


def tick(path: str, seconds: float) -> None:
    """Append a byte to `path` every 20 ms for `seconds`: a test sees whether it runs."""
    end = time.monotonic() + seconds
    with open(path, "ab", buffering=0) as f:
        while time.monotonic() < end:
            f.write(b".")
            time.sleep(0.02)
