"""A service process settles its memory once it is ready: what it built to start is frozen out
of the cyclic garbage collector's full collections (shared.runtime.serve)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from shared import runtime
from shared.runtime import serve


class Toy:
    """A service as serve() sees it: run(), stop(), and the ready event shared.service has."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.stopping = asyncio.Event()
        self.frozen_at_ready: int | None = None

    async def run(self) -> None:
        self.frozen_at_ready = gc.get_freeze_count()
        self.ready.set()
        await self.stopping.wait()

    def stop(self) -> None:
        self.stopping.set()


async def test_what_a_service_built_to_start_is_frozen_once_it_is_ready_and_young_collections_thin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gc.unfreeze()
    threshold = gc.get_threshold()
    settled = asyncio.Event()

    def settle_memory() -> None:
        real_settle()
        settled.set()

    real_settle = runtime.settle_memory
    monkeypatch.setattr(runtime, "settle_memory", settle_memory)
    toy = Toy()
    serving = asyncio.create_task(serve(toy))
    try:
        await asyncio.wait_for(settled.wait(), 10)
        assert toy.frozen_at_ready == 0  # not before it was ready
        assert gc.get_freeze_count() > 1000  # the modules, at least
        assert gc.get_threshold() == (runtime.GC_YOUNG, *threshold[1:])
    finally:
        toy.stop()
        await asyncio.wait_for(serving, 10)
        gc.unfreeze()
        gc.set_threshold(*threshold)


async def test_first_done_returns_on_the_first_and_cancels_none() -> None:
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    loop.call_soon(b.set_result, 2)
    await asyncio.wait_for(runtime.first_done(a, b), 5)
    assert b.done()
    assert not a.done()
    a.set_result(1)  # a later completion wakes nobody: the callbacks are gone
    await asyncio.sleep(0)
    await asyncio.wait_for(runtime.first_done(a, b), 5)  # done already: at once


async def test_first_done_cancelled_leaves_what_it_waited_for() -> None:
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    waiting = asyncio.create_task(runtime.first_done(a, b))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not a.cancelled()
    assert not b.cancelled()
    a.set_result(None)
    b.set_result(None)


def test_an_attempt_with_no_hook_installed_is_observed_by_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shared import hooks

    monkeypatch.setattr(hooks, "installed", [])  # other tests install theirs for the process
    with hooks.attempt(None, "n", None) as seen:  # type: ignore[arg-type]
        seen.ended(False, "nobody hears this")
    with hooks.attempt(None, "n", None) as again:  # type: ignore[arg-type]
        assert again is seen  # one shared context, nothing built an attempt


def test_a_service_process_is_closed_to_its_user_s_other_processes() -> None:
    """run_service makes the process undumpable before anything else: a task of the same
    user can then read neither its /proc/<pid>/environ (the database URL, the heartbeat
    secret) nor ptrace it. In a child, so this test process stays as it was."""
    import subprocess
    import sys

    script = (
        "import ctypes\n"
        "from shared.runtime import keep_private\n"
        "prctl = ctypes.CDLL(None).prctl\n"
        "before = prctl(3, 0, 0, 0, 0)\n"  # PR_GET_DUMPABLE
        "keep_private()\n"
        "print(before, prctl(3, 0, 0, 0, 0))\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert shown.stdout.split() == ["1", "0"]


def test_run_service_keeps_private_first(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(runtime, "keep_private", lambda: calls.append("private"))
    monkeypatch.setattr(runtime, "open_files_to_the_limit", lambda: None)
    monkeypatch.setattr(runtime, "run_main", lambda main: calls.append("main") or 0)
    # nothing of this process's logging, tracing or metrics set up for a test
    monkeypatch.setattr(runtime, "configure_logging", lambda *a: None)
    monkeypatch.setattr(runtime.telemetry, "setup", lambda *a: None)
    monkeypatch.setattr(runtime.metrics, "setup", lambda *a: None)
    from shared.settings import Settings

    assert runtime.run_service("toy", Settings(), lambda _: asyncio.sleep(0)) == 0
    assert calls == ["private", "main"]
