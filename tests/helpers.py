"""Helpers shared by the tests: spec and row factories and a bounded `eventually`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from shared.fsm import State
from shared.models import Task, TaskSpec

T = TypeVar("T")
_proc_ids = itertools.count(1)


def spec(name: str = "t", **kw: Any) -> TaskSpec:
    """A valid command spec; keyword arguments override fields."""
    data: dict[str, Any] = {"name": name, "job": {"kind": "command", "argv": ["true"]}}
    data.update(kw)
    return TaskSpec.parse(data)


def task_row(**kw: Any) -> dict[str, Any]:
    """A row of every column a Task is read from, as a statement returns it (a Ready task, its
    status a string); keyword arguments override columns."""
    from tests.fakes.store import new_task

    task = new_task(spec(), status=State.READY, version=3, attempt=1)
    row = {f.name: getattr(task, f.name) for f in fields(Task)}
    row["status"] = task.status.value
    row.update(kw)
    return row


async def eventually(
    probe: Callable[[], Awaitable[T]],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll `probe` until it returns something truthy; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = await probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)


SKED = str(Path(sys.executable).with_name("sked"))


class ServiceProcess:
    """A sked service run as its own process (`sked service NAME`), its log in a file."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path, *args: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}-{next(_proc_ids)}.log"
        self.killed = False  # killed on purpose: its exit code says nothing
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [SKED, "service", name, *args], env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")

    async def wait_for_log(self, text: str, timeout: float = 30.0) -> None:
        async def seen() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited early:\n{self.log()}")
            return text in self.log()

        await eventually(seen, timeout=timeout, what=f"{self.name} to log {text!r}")

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, like a crashed host."""
        self.killed = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit within `timeout`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


@contextlib.asynccontextmanager
async def loop_stalls(every: float = 0.05) -> AsyncIterator[list[float]]:
    """The event loop's longest stall while the block runs: a ticker wakes every `every` s and
    records each gap between its wakes; yields the list of gaps (`max` of it, after)."""
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        yield gaps
    finally:
        ticker.cancel()
