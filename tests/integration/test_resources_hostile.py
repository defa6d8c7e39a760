"""A task exhausting what the local backend gives it: the executor's disk through its log, and
a handler's worker through fork. Each case was found by an adversarial review, where it failed:
the docstrings say what happened; each test shows it no longer does. Handlers the tests run are
defined here and run in the handler workers as `tests.integration.test_resources_hostile:<name>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from services.executor.backends import Launch, Outcome
from services.executor.backends.local import LocalBackend
from services.executor.backends.local.logcap import bound, trim
from shared.models import CommandJob, HandlerJob

HERE = "tests.integration.test_resources_hostile"
LIMIT = 1024 * 1024  # the tests' SKED_LOG_MAX_BYTES


# --- handlers (run in the workers) -------------------------------------------------------------


def fork_and_return_twice(delay: float) -> int:
    pid = os.fork()
    if pid == 0:
        return os.getpid()  # the child goes on as a worker
    time.sleep(delay)
    return os.getpid()


def noisy(mb: int, pause: float) -> int:
    block = b"y" * (1 << 20)
    for i in range(mb):
        os.write(1, block)
        if i % 5 == 4:
            time.sleep(pause)
    os.write(1, b"done\n")
    return mb


def quick() -> int:
    return 7


def nap(seconds: float) -> int:
    time.sleep(seconds)
    return 7


# --- helpers -----------------------------------------------------------------------------------


def command(script: str, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, CommandJob(argv=["sh", "-c", script]), timeout_s)


def handler(name: str, args: Any = None, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}", args=args), timeout_s)


async def run(backend: LocalBackend, launch: Launch, within: float = 30) -> Outcome:
    async with asyncio.timeout(within):
        return await backend.run(launch)


def log_of(backend: LocalBackend, launch: Launch) -> Path:
    return backend.state_dir / "logs" / f"{launch.task_id}-{launch.attempt}.log"


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    """A backend whose watch runs, as the executor's does: the log bound is kept there."""
    b = LocalBackend(2, tmp_path / "state", warm_workers=0, log_max_bytes=LIMIT)
    await b.start()
    watching = asyncio.create_task(b.watch())
    yield b
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    await b.close()


# --- cases -------------------------------------------------------------------------------------


async def test_a_command_s_log_is_bounded(backend: LocalBackend) -> None:
    """A command task writes 200 MB to stdout, in bursts over a second or two. Its log was
    the whole 200 MB: the shim points fds 1 and 2 straight at the log file and nothing
    bounded it (retention prunes by age, and never a running attempt's log), so one chatty
    or hostile task filled the executor's disk. Now SKED_LOG_MAX_BYTES holds it: cut to its
    last half while it runs, and once more when it ends; the end of its output is kept, and
    the cut is said in the log."""
    script = "for i in $(seq 40); do head -c 5M /dev/zero; sleep 0.03; done; echo done"
    launch = command(script)
    outcome = await run(backend, launch, 60)
    data = log_of(backend, launch).read_bytes()
    assert outcome.ok, outcome
    assert len(data) <= LIMIT, f"the attempt's log is {len(data)} bytes, over {LIMIT}"
    assert data.startswith(b"[sked: ")
    assert b"bytes of earlier output dropped" in data[:200]
    assert data.endswith(b"done\n")
    assert outcome.log_tail.endswith("done\n")


async def test_a_handler_s_log_is_bounded_while_it_runs(backend: LocalBackend) -> None:
    """A handler job writes 200 MB to its stdout over a few seconds. Its output went to the
    worker's out file and was moved whole to the attempt's log: 200 MB. Now the worker's out
    file is cut while the job runs, and the log once more when the job ends."""
    launch = handler("noisy", [200, 0.1])
    outcome = await run(backend, launch, 60)
    data = log_of(backend, launch).read_bytes()
    assert outcome.ok, outcome
    assert len(data) <= LIMIT, f"the attempt's log is {len(data)} bytes of 200 MB written"
    assert data.startswith(b"[sked: ")
    assert b"bytes of earlier output dropped" in data[:200]
    assert data.endswith(b"done\n")


def _consecutive(data: bytes) -> list[int]:
    """The numbers `seq` wrote, whole lines only (a cut and a kill land mid-line); raises
    AssertionError unless each follows the one before."""
    numbers = [int(line) for line in data.split(b"\n")[1:-1]]
    assert numbers, "no whole line"
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "out of order"
    return numbers


def _live_data(path: Path) -> bytes:
    """What a live log holds after the hole a cut punched at its head (a cut racing the
    read makes zeros of what it had not read yet: what follows them)."""
    with path.open("rb") as f:
        try:
            f.seek(os.lseek(f.fileno(), 0, os.SEEK_DATA))
        except OSError:  # nothing written yet
            return b""
        data = f.read()
    if data.startswith(b"[sked: "):  # the attempt ended: rewritten behind its note
        return data.partition(b"\n")[2]
    return data[data.rfind(b"\0") + 1 :]


async def test_a_log_cut_while_it_is_written_keeps_its_order(backend: LocalBackend) -> None:
    """A command writes numbered lines without pause (`seq`) far past SKED_LOG_MAX_BYTES,
    and its log is read while it runs and when it ends. A cut truncated the live file and
    wrote its last half back: what the task appended between the two went to the file's
    start, ahead of what it followed (a third of the cuts, in a review's count), so the log
    read newest lines, the note, then older ones, and its end was not the task's last
    output. Now a live cut frees the head in place and moves nothing; the rewrite behind the
    note waits for the attempt's end. Every read is one run of consecutive numbers."""
    launch = command("exec seq 1 1000000000", timeout_s=3)
    path = log_of(backend, launch)
    running = asyncio.create_task(run(backend, launch, 60))
    reads = 0
    while not running.done():
        await asyncio.sleep(0.05)
        with contextlib.suppress(FileNotFoundError):
            data = await asyncio.to_thread(_live_data, path)
            if data.count(b"\n") > 2:
                _consecutive(data)
                reads += 1
    await running
    data = path.read_bytes()
    assert len(data) <= LIMIT, len(data)
    note, _, rest = data.partition(b"\n")
    assert note.startswith(b"[sked: "), note
    assert b"bytes of earlier output dropped" in note, note
    assert len(_consecutive(rest)) > 1000
    assert reads >= 3, reads


def test_a_trim_follows_no_link_and_reads_no_fifo(tmp_path: Path) -> None:
    """The bound is kept by path, at paths a task can reach: a symlink planted at one is not
    followed (the file it names keeps its bytes), and a FIFO is not opened for reading."""
    target = tmp_path / "precious"
    target.write_bytes(b"x" * (2 * LIMIT))
    link = tmp_path / "link.log"
    link.symlink_to(target)
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    assert trim(str(link), LIMIT) == 0
    assert target.stat().st_size == 2 * LIMIT
    assert trim(str(fifo), LIMIT) == 0


async def test_a_handler_that_forks_and_returns_in_the_child_fails_no_innocent_job(
    tmp_path: Path,
) -> None:
    """A handler forks and returns in both processes (a common bug: a fork without os._exit
    in the child). The child went on as a second copy of the worker: it wrote a reply for
    the job and read the next job, another task's, from the shared pipe; the worker wrote
    its own reply, a second line naming the same job, which the executor took for a breach
    of the protocol: it killed the worker, and the innocent job failed with "handler worker
    wrote a line that is not this job's reply". Now a fork that returns into the worker's
    code ends there (Worker.run): only the worker replies, and the innocent job succeeds."""
    b = LocalBackend(1, tmp_path / "state", warm_workers=1)
    await b.start()
    try:
        assert (await run(b, handler("quick"))).ok  # the worker has imported this module
        bad = await run(b, handler("fork_and_return_twice", [0.3]))
        good = await run(b, handler("nap", [1.0]))  # another task's job, on the same worker
        later = [await run(b, handler("quick")) for _ in range(3)]
    finally:
        await b.close()
    assert (good.ok, good.result) == (True, 7), (good, bad)
    assert all(o.ok for o in later), later


async def test_a_task_that_removes_the_workers_directory_does_not_stop_the_bound(
    tmp_path: Path,
) -> None:
    """A command removes the state directory's `workers` (it runs as the executor's user and
    can). The bound's look at the files being written listed that directory and raised, which
    ended the backend's watch: the executor took its backend for failed and stopped. Now that
    look is skipped once, said, and the watch runs on."""
    backend = LocalBackend(1, tmp_path / "state", warm_workers=0, log_max_bytes=LIMIT)
    await backend.start()
    watching = asyncio.create_task(backend.watch())
    try:
        workers = backend.state_dir / "workers"
        outcome = await run(backend, command(f"rm -rf {workers}; sleep 1"))
        await asyncio.sleep(0.6)
        assert outcome.ok, outcome
        assert not watching.done(), watching.exception()
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await backend.close()


async def test_a_log_written_through_dev_stdout_is_not_cut_to_nul_bytes(
    backend: LocalBackend,
) -> None:
    """A command (sh, i.e. dash) sends a loop's output `> /dev/stdout`, as many scripts do:
    dash opens /proc/self/fd/1 afresh, O_WRONLY without O_APPEND, so that writer has an
    offset of its own. It writes ~8 MB of text (no NUL byte), then "done". Should: the log
    is bounded and holds the end of the output behind the cut's note. Each cut truncated the
    file but the writer went on at its old offset, so the file grew a hole (read as NUL
    bytes) where the cut output was; the next cut kept the last half, mostly hole, and wrote
    it back as real NUL bytes. Now a cut keeps only what was written (holes skipped, and
    bounded by the bytes stored, not the size that counts the hole), and the log is compacted
    once its attempt ends."""
    script = (
        "for i in $(seq 80); do head -c 75000 /dev/urandom | base64; sleep 0.02; done "
        "> /dev/stdout; echo done"
    )
    launch = Launch(uuid4(), 1, CommandJob(argv=["sh", "-c", script]), None)
    path = backend.state_dir / "logs" / f"{launch.task_id}-{launch.attempt}.log"
    seen = 0

    async def watch() -> None:
        nonlocal seen
        while True:
            with contextlib.suppress(OSError):
                seen = max(seen, path.stat().st_size)
            await asyncio.sleep(0.01)

    w = asyncio.create_task(watch())
    try:
        async with asyncio.timeout(60):
            outcome: Outcome = await backend.run(launch)
    finally:
        w.cancel()
    data = path.read_bytes()
    nul = data.count(b"\0")
    assert outcome.ok, outcome
    assert nul == 0, (
        f"the log ({len(data)} bytes) holds {nul} NUL bytes the task never wrote; "
        f"its apparent size reached {seen} bytes (limit {LIMIT})"
    )


async def test_two_cuts_of_one_log_do_not_interleave(tmp_path: Path) -> None:
    """An attempt's last cut (when it ends) may come while the periodic one is under way, two
    threads on one file: truncating and writing in turn, they could keep its last half twice.
    Now the last waits for the one under way, and a periodic one is skipped while another
    runs."""
    path = tmp_path / "a.log"
    path.write_bytes(b"x" * (4 * LIMIT) + b"end\n")
    await asyncio.gather(
        *(bound(str(path), LIMIT) for _ in range(3)), bound(str(path), LIMIT, compact=True)
    )
    data = path.read_bytes()
    assert data.count(b"bytes of earlier output dropped") == 1
    assert data.count(b"end\n") == 1
    assert len(data) <= LIMIT


async def test_a_cancelled_cut_still_keeps_the_next_one_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attempt stopped while its log was being cut cancelled `bound()`, and the cut's
    registration went with it, while its thread (which cannot be cancelled) went on
    truncating and writing the file: the next cut of that file then ran beside it, as two
    interleaved cuts did before 39c84ae. Now a cut stays registered until its thread is done."""
    from services.executor.backends.local import logcap

    release = threading.Event()
    running: list[int] = []
    overlap: list[int] = []

    def slow_trim(path: str, limit: int, *, compact: bool = False) -> int:
        running.append(1)
        overlap.append(len(running))
        try:
            release.wait(10)
            return trim(path, limit, compact=compact)
        finally:
            running.pop()

    monkeypatch.setattr(logcap, "trim", slow_trim)
    path = tmp_path / "a.log"
    path.write_bytes(b"x" * (4 * LIMIT) + b"end\n")
    first = asyncio.create_task(bound(str(path), LIMIT))
    for _ in range(200):
        if running:
            break
        await asyncio.sleep(0.01)
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    second = asyncio.create_task(bound(str(path), LIMIT, compact=True))
    await asyncio.sleep(0.2)
    release.set()
    await asyncio.wait_for(second, 10)
    assert max(overlap) == 1, "two cuts of one file ran at once"
    data = path.read_bytes()
    assert data.count(b"end\n") == 1
