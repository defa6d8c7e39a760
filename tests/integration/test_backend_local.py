"""The executor's local backend against real processes: commands, handler workers, stops,
timeouts, and reaping what an executor killed with SIGKILL left running."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest

from services.executor.backends import Launch, Outcome
from services.executor.backends.local import LocalBackend, workers
from services.executor.backends.local import worker as worker_main
from services.executor.backends.local.pool import MIN_RECENT, RECENT_JOBS
from shared.models import CommandJob, HandlerJob
from tests.helpers import eventually

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(worker_main.__file__)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "stat").read_bytes()
            except OSError:
                continue
            ppid = int(raw[raw.rindex(b")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    b = LocalBackend(2, tmp_path / "state")
    await b.start()
    yield b
    await b.close()


def command(script: str, timeout_s: float | None = None, **env: str) -> Launch:
    return Launch(uuid4(), 1, CommandJob(argv=["sh", "-c", script]), timeout_s, env)


def handler(name: str, args: Any = None, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"tests.handlers:{name}", args=args), timeout_s)


async def run(backend: LocalBackend, launch: Launch) -> Outcome:
    async with asyncio.timeout(30):
        return await backend.run(launch)


def gone(pid: int) -> bool:
    """No such process, or a zombie (a reparented one may never be reaped in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 :].split()[0] == b"Z"


async def until(check: Any, what: str, timeout: float = 10.0) -> None:
    async def probe() -> bool:
        return bool(check())

    await eventually(probe, timeout=timeout, interval=0.02, what=what)


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def records(state: Path) -> list[Path]:
    """The command attempts' records."""
    return sorted((state / "running").glob("*.json"))


def worker_records(state: Path) -> list[Path]:
    """The handler workers' records (a handler job has none of its own)."""
    return sorted((state / "running").glob("*.worker"))


# --- commands --------------------------------------------------------------------------------


async def test_command_success_with_environment_and_log(backend: LocalBackend) -> None:
    launch = Launch(
        uuid4(),
        3,
        CommandJob(
            argv=["sh", "-c", 'echo out; echo err >&2; echo "$SKED_TASK_ID $SKED_ATTEMPT $A $B"'],
            env={"A": "from-job"},
        ),
        None,
        {"B": "from-launch"},
    )
    outcome = await run(backend, launch)
    assert outcome == Outcome(
        ok=True,
        result={"exit_code": 0},
        error=None,
        timed_out=False,
        stopped=False,
        log_tail=f"out\nerr\n{launch.task_id} 3 from-job from-launch\n",
    )
    log_file = backend.state_dir / "logs" / f"{launch.task_id}-3.log"
    assert log_file.read_text() == outcome.log_tail
    assert backend.running() == set()
    assert records(backend.state_dir) == []


async def test_command_nonzero_exit(backend: LocalBackend) -> None:
    outcome = await run(backend, command("echo failing; exit 3"))
    assert not outcome.ok
    assert outcome.result == {"exit_code": 3}
    assert outcome.error == "exit code 3"
    assert outcome.log_tail == "failing\n"


async def test_command_killed_by_a_signal(backend: LocalBackend) -> None:
    outcome = await run(backend, command("kill -SEGV $$"))
    assert outcome.result == {"exit_code": -signal.SIGSEGV}
    assert outcome.error == "killed by SIGSEGV"


async def test_missing_executable_and_bad_cwd(backend: LocalBackend, tmp_path: Path) -> None:
    missing = Launch(uuid4(), 1, CommandJob(argv=["nope-not-a-program"]), None)
    outcome = await run(backend, missing)
    assert not outcome.ok
    assert outcome.result is None
    assert outcome.error == (
        "could not start: [Errno 2] No such file or directory: 'nope-not-a-program'"
    )
    bad_cwd = Launch(uuid4(), 1, CommandJob(argv=["true"], cwd=str(tmp_path / "nope")), None)
    outcome = await run(backend, bad_cwd)
    assert outcome.error is not None
    assert outcome.error.startswith("could not start: [Errno 2]")
    assert backend.running() == set()


async def test_log_tail_is_the_end_of_the_output(tmp_path: Path) -> None:
    b = LocalBackend(0, tmp_path / "state", log_tail_bytes=100)
    await b.start()
    try:
        outcome = await run(b, command("seq 1 100000"))
    finally:
        await b.close()
    assert outcome.ok
    assert len(outcome.log_tail) == 100
    assert outcome.log_tail.endswith("\n99999\n100000\n")


async def test_timeout_kills_the_whole_process_group(backend: LocalBackend, tmp_path: Path) -> None:
    pidfile = tmp_path / "sleep.pid"
    started = time.monotonic()
    outcome = await run(
        backend, command(f"echo started; sleep 100 & echo $! > {pidfile}; wait", 0.5)
    )
    assert time.monotonic() - started < 5
    assert outcome.timed_out
    assert not outcome.ok
    assert not outcome.stopped
    assert outcome.result is None
    assert outcome.error == "timed out after 0.5 s"
    assert outcome.log_tail == "started\n"
    grandchild = read_pid(pidfile)
    assert grandchild is not None
    await until(lambda: gone(grandchild), "the grandchild sleep to be killed")
    assert records(backend.state_dir) == []


async def test_background_jobs_do_not_outlive_their_attempt(
    backend: LocalBackend, tmp_path: Path
) -> None:
    pidfile = tmp_path / "sleep.pid"
    outcome = await run(backend, command(f"sleep 100 & echo $! > {pidfile}"))
    assert outcome.ok
    grandchild = read_pid(pidfile)
    assert grandchild is not None
    await until(lambda: gone(grandchild), "the left-behind sleep to be killed")


async def test_stop_a_running_command(backend: LocalBackend, tmp_path: Path) -> None:
    pidfile = tmp_path / "sleep.pid"
    launch = command(f"sleep 100 & echo $! > {pidfile}; wait")
    running = asyncio.create_task(run(backend, launch))
    await until(lambda: read_pid(pidfile), "the command to start")
    assert backend.running() == {(launch.task_id, 1)}
    assert len(records(backend.state_dir)) == 1

    assert await backend.stop_task(launch.task_id, 1)
    outcome = await running
    assert outcome.stopped
    assert not outcome.ok
    assert not outcome.timed_out
    assert outcome.error == "stopped"
    assert outcome.result is None
    grandchild = read_pid(pidfile)
    assert grandchild is not None
    await until(lambda: gone(grandchild), "the grandchild sleep to be killed")
    assert not await backend.stop_task(launch.task_id, 1)
    assert backend.running() == set()
    assert records(backend.state_dir) == []


async def test_run_is_idempotent_per_attempt(backend: LocalBackend, tmp_path: Path) -> None:
    lines = tmp_path / "lines"
    launch = command(f"echo ran >> {lines}; sleep 0.3")
    first, second = await asyncio.gather(run(backend, launch), run(backend, launch))
    assert first is second
    assert first.ok
    assert lines.read_text() == "ran\n"


# --- handlers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "result"),
    [
        ("echo", {"a": 1, "b": [2, None]}, {"a": 1, "b": [2, None]}),
        ("add", [2, 3], 5),
        ("noop", None, None),
        ("double", 2.5, 5.0),
        ("slow_add", {"a": 1, "b": 2}, 3),
    ],
)
async def test_handler_results(backend: LocalBackend, name: str, args: Any, result: Any) -> None:
    outcome = await run(backend, handler(name, args))
    assert outcome.ok, outcome
    assert outcome.result == result
    assert outcome.error is None
    assert records(backend.state_dir) == []


async def test_handler_output_and_environment(backend: LocalBackend) -> None:
    outcome = await run(backend, handler("echo", {"x": 1}))
    assert outcome.log_tail == "echo ['x']\n"
    launch = handler("environ", ["SKED_TASK_ID"])
    assert (await run(backend, launch)).result == str(launch.task_id)
    job = HandlerJob(handler="tests.handlers:environ", args=["EXTRA"])
    with_extra = Launch(uuid4(), 1, job, None, {"EXTRA": "yes"})
    assert (await run(backend, with_extra)).result == "yes"
    # set for one job only: the worker's next job does not see it
    results = await asyncio.gather(*(run(backend, Launch(uuid4(), 1, job, None)) for _ in range(2)))
    assert [o.result for o in results] == [None, None]


async def test_handler_raises(backend: LocalBackend) -> None:
    launch = handler("fail")
    outcome = await run(backend, launch)
    assert not outcome.ok
    assert outcome.result is None
    assert outcome.error == "ValueError: bad"
    assert outcome.log_tail.startswith("about to fail\nTraceback (most recent call last):")
    assert outcome.log_tail.endswith("ValueError: bad\n")
    log_file = backend.state_dir / "logs" / f"{launch.task_id}-1.log"
    assert log_file.read_text() == outcome.log_tail


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("tests.nope:func", "could not import 'tests.nope:func': ModuleNotFoundError: No module"),
        ("tests.handlers.missing", "could not import 'tests.handlers.missing': AttributeError:"),
    ],
)
async def test_handler_that_does_not_import(backend: LocalBackend, path: str, error: str) -> None:
    outcome = await run(backend, Launch(uuid4(), 1, HandlerJob(handler=path), None))
    assert not outcome.ok
    assert outcome.error is not None
    assert outcome.error.startswith(error)
    assert "Traceback" in outcome.log_tail


async def test_handler_result_that_is_not_json(backend: LocalBackend) -> None:
    outcome = await run(backend, handler("not_json"))
    assert not outcome.ok
    assert outcome.error == (
        "result is not JSON: TypeError: Object of type set is not JSON serializable"
    )


async def test_handler_that_ends_its_worker(backend: LocalBackend) -> None:
    outcome = await run(backend, handler("exit_now", 3))
    assert not outcome.ok
    assert outcome.error == "handler worker died: exit code 3"
    assert outcome.log_tail == "bye\n"
    assert (await run(backend, handler("add", [1, 1]))).result == 2


async def test_handler_timeout(backend: LocalBackend) -> None:
    outcome = await run(backend, handler("sleep", [60], timeout_s=0.5))
    assert outcome.timed_out
    assert outcome.error == "timed out after 0.5 s"
    assert outcome.log_tail == "sleeping\nto stderr\n"
    assert (await run(backend, handler("add", [1, 1]))).result == 2


async def test_a_process_an_earlier_job_left_running_ends_with_that_job(tmp_path: Path) -> None:
    """A process a handler job started and left running is killed, with its tree, as the job
    ends (before its reply: a retry never runs beside it), so nothing it would print later
    reaches the next job's log. (It once ran on, and only the worker's output file was cut
    before the next job.)"""
    b = LocalBackend(1, tmp_path / "state")
    await b.start()
    try:
        written = tmp_path / "written"
        first = await run(b, handler("leave_writer", [0.2, "late", str(written)]))
        assert first.ok, first.error
        await asyncio.sleep(0.6)  # three times what the writer waits before it writes
        assert not written.exists(), "the earlier job's process ran on after its job"
        second = await run(b, handler("echo", {"x": 1}))
        assert second.ok, second.error
        assert "late" not in second.log_tail, second.log_tail
    finally:
        await b.close()


async def test_stop_a_running_handler(backend: LocalBackend, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    launch = handler("sleep", [60, str(marker)])
    running = asyncio.create_task(run(backend, launch))
    await until(marker.exists, "the handler to start")
    assert backend.running() == {(launch.task_id, 1)}
    assert records(backend.state_dir) == []  # its worker's record names its group
    assert worker_records(backend.state_dir)

    assert await backend.stop_task(launch.task_id, 1)
    outcome = await running
    assert outcome.stopped
    assert outcome.error == "stopped"
    assert outcome.log_tail == "sleeping\nto stderr\n"
    assert records(backend.state_dir) == []
    assert (await run(backend, handler("add", [2, 2]))).result == 4


async def test_pool_keeps_its_workers(backend: LocalBackend, tmp_path: Path) -> None:
    # A worker killed from outside while idle: the next job goes to a fresh one.
    pids = {(await run(backend, handler("pid"))).result for _ in range(4)}
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    await until(lambda: all(gone(pid) for pid in pids), "the workers to die")
    outcomes = await asyncio.gather(*(run(backend, handler("pid")) for _ in range(4)))
    assert all(o.ok for o in outcomes), outcomes
    assert not pids & {o.result for o in outcomes}

    # After a stop, both slots still have a worker: two jobs run side by side.
    marker = tmp_path / "marker"
    stopped = handler("sleep", [60, str(marker)])
    running = asyncio.create_task(run(backend, stopped))
    await until(marker.exists, "the handler to start")
    await backend.stop_task(stopped.task_id, 1)
    assert (await running).stopped
    markers = [tmp_path / f"m{i}" for i in range(2)]
    both = asyncio.gather(*(run(backend, handler("sleep", [60, str(m)])) for m in markers))
    await until(lambda: all(m.exists() for m in markers), "two handlers to run at once")
    await backend.close()
    assert all(o.stopped for o in await both)


async def test_a_line_left_behind_by_a_job_is_not_the_next_jobs_reply(tmp_path: Path) -> None:
    """A handler that leaves a thread behind, which writes a reply-like line to the worker's
    reply pipe during the next job: that job's outcome is not that line. Each reply names its
    job; the worker that wrote another is killed, and the job fails saying so."""
    b = LocalBackend(1, tmp_path / "state", warm_workers=1)
    await b.start()
    forged = json.dumps({"ok": True, "result": "forged"})
    try:
        first = await run(b, handler("reply_later", [0.3, forged]))
        second = await run(b, handler("sleep", [1.0]))
        third = await run(b, handler("add", [1, 2]))
    finally:
        await b.close()
    assert (first.ok, first.result) == (True, "mine")
    assert second.result != "forged"
    assert not second.ok
    assert "not this job's reply" in (second.error or "")
    assert (third.ok, third.result) == (True, 3)  # a fresh worker


async def test_the_worker_that_answered_last_takes_the_next_job(tmp_path: Path) -> None:
    """Jobs one at a time go to one worker, not round all the slots' workers in turn: its
    memory is still in the CPU's caches."""
    b = LocalBackend(4, tmp_path / "state", warm_workers=4)
    await b.start()
    try:
        one_at_a_time = {(await run(b, handler("pid"))).result for _ in range(6)}
    finally:
        await b.close()
    assert len(one_at_a_time) == 1


async def test_a_worker_is_retired_after_max_jobs(tmp_path: Path) -> None:
    """Each job's environment costs a worker memory glibc never frees (setenv keeps every
    value it was given), so a worker that has taken max_jobs jobs is replaced by a fresh one
    off the job's path; every job is answered."""
    b = LocalBackend(1, tmp_path / "state", warm_workers=1, worker_max_jobs=3)
    await b.start()
    try:
        pids = [(await run(b, handler("pid"))).result for _ in range(7)]
    finally:
        await b.close()
    assert pids[0] == pids[1] == pids[2]
    assert pids[3] == pids[4] == pids[5]
    assert len({pids[0], pids[3], pids[6]}) == 3
    await until(lambda: gone(pids[0]) and gone(pids[3]), "the retired workers to exit")


# --- jobs waiting at a busy worker --------------------------------------------------------


@pytest.fixture
def _nudges_answer_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop or a timeout waits for a nudge's answer at most NUDGE_WAIT_S; here a minute, so
    that a test whose stop waited the bound out instead of for the answer times out."""
    monkeypatch.setattr(workers, "NUDGE_WAIT_S", 60.0)


async def started_backend(tmp_path: Path, slots: int = 4, **pool: Any) -> LocalBackend:
    """A backend whose recent jobs ran short, so that a job may wait at a busy worker."""
    b = LocalBackend(slots, tmp_path / "state", warm_workers=slots)
    await b.start()
    for name, value in pool.items():
        setattr(b._pool, name, value)
    for _ in range(MIN_RECENT):
        assert (await run(b, handler("noop"))).ok
    return b


async def test_short_jobs_given_at_once_wait_at_one_worker(tmp_path: Path) -> None:
    """While the node's jobs run short, jobs given together go to one busy worker, in
    order, rather than each waking an idle one; jobs of long-running handlers do not."""
    b = await started_backend(tmp_path)
    try:
        short = await asyncio.gather(*(run(b, handler("pid")) for _ in range(4)))
        assert all(o.ok for o in short), short
        assert len({o.result for o in short}) == 1
        # the same with queueing off: each job its own worker
        b._pool.depth = 1
        spread = await asyncio.gather(*(run(b, handler("sleep_pid", [0.2])) for _ in range(4)))
        assert len({o.result for o in spread}) == 4
    finally:
        await b.close()


async def test_short_jobs_do_not_wait_once_jobs_run_long(tmp_path: Path) -> None:
    b = await started_backend(tmp_path)
    try:
        for _ in range(RECENT_JOBS // 4):  # a quarter of the recent jobs at 0.1 s
            assert (await run(b, handler("sleep_pid", [0.1]))).ok
        assert not b._pool.short()
        spread = await asyncio.gather(*(run(b, handler("sleep_pid", [0.2])) for _ in range(4)))
        assert len({o.result for o in spread}) == 4
    finally:
        await b.close()


@pytest.mark.usefixtures("_nudges_answer_at_once")
async def test_jobs_waiting_behind_a_slow_one_are_taken_back(tmp_path: Path) -> None:
    """A job that turns out slow keeps no job waiting behind it: after rescue_s the worker is
    nudged, gives back what it had not started, and those run on other workers at once."""
    b = await started_backend(tmp_path)
    try:
        slow = asyncio.create_task(run(b, handler("sleep_pid", [3.0])))
        behind = [asyncio.create_task(run(b, handler("pid"))) for _ in range(3)]
        started = time.monotonic()
        async with asyncio.timeout(2.0):  # long before the slow one ends
            fast = await asyncio.gather(*behind)
        assert time.monotonic() - started < 2.0
        assert all(o.ok for o in fast), fast
        assert (await slow).result not in {o.result for o in fast}
    finally:
        await b.close()


@pytest.mark.usefixtures("_nudges_answer_at_once")
async def test_a_job_stopped_while_it_waits_never_runs(tmp_path: Path) -> None:
    b = await started_backend(tmp_path, rescue_s=60.0)
    marker, never = tmp_path / "marker", tmp_path / "never"
    try:
        slow = handler("sleep_pid", [60, str(marker)])
        waiting = handler("touch", [str(never)])
        running = asyncio.create_task(run(b, slow))
        queued = asyncio.create_task(run(b, waiting))
        await until(marker.exists, "the slow job to start")
        assert await b.stop_task(waiting.task_id, 1)
        outcome = await queued
        assert outcome.stopped
        assert not never.exists()
        assert not running.done()  # its worker was not killed for it
        assert (await run(b, handler("add", [1, 2]))).result == 3
        assert await b.stop_task(slow.task_id, 1)
        assert (await running).stopped
        assert records(b.state_dir) == []
    finally:
        await b.close()


@pytest.mark.usefixtures("_nudges_answer_at_once")
@pytest.mark.parametrize("how", ["stopped", "timed out", "died"])
async def test_jobs_behind_one_that_is_killed_run_elsewhere(tmp_path: Path, how: str) -> None:
    """The worker running a job that is stopped, times out or dies ends; the jobs waiting
    behind it never started, and run on other workers."""
    b = await started_backend(tmp_path, rescue_s=60.0)
    marker = tmp_path / "marker"
    try:
        if how == "died":
            first = handler("exit_now", [3])
        else:
            first = handler(
                "sleep", [60, str(marker)], timeout_s=0.5 if how == "timed out" else None
            )
        ahead = asyncio.create_task(run(b, first))
        behind = [asyncio.create_task(run(b, handler("add", [i, 1]))) for i in range(3)]
        if how == "stopped":
            await until(marker.exists, "the first job to start")
            assert await b.stop_task(first.task_id, 1)
        outcome = await ahead
        assert [(await t).result for t in behind] == [1, 2, 3]
    finally:
        await b.close()
    if how == "stopped":
        assert outcome.stopped
    elif how == "timed out":
        assert outcome.timed_out
        assert outcome.log_tail == "sleeping\nto stderr\n"
    else:
        assert outcome.error == "handler worker died: exit code 3"
        assert outcome.log_tail == "bye\n"


async def test_a_handler_deaf_to_nudges_delays_the_jobs_behind_but_runs_none_twice(
    tmp_path: Path,
) -> None:
    """A handler that ignores SIGUSR1 keeps the jobs behind it waiting until it ends (the
    rescue gets no answer); each then runs once, and the worker that never answered is
    replaced before it takes another job."""
    b = await started_backend(tmp_path)
    marker, ran = tmp_path / "marker", tmp_path / "ran"
    try:
        deaf = asyncio.create_task(run(b, handler("deaf_sleep", [1.0, str(marker)])))
        behind = [asyncio.create_task(run(b, handler("count", [str(ran)]))) for _ in range(2)]
        outcomes = await asyncio.gather(deaf, *behind)
        assert all(o.ok for o in outcomes), outcomes
        assert ran.read_text() == "ran\n" * 2
        deaf_pid = outcomes[0].result
        assert {o.result for o in outcomes[1:]} == {deaf_pid}  # they waited for it
        later = await asyncio.gather(*(run(b, handler("pid")) for _ in range(4)))
        assert deaf_pid not in {o.result for o in later}
    finally:
        await b.close()


@pytest.mark.usefixtures("_nudges_answer_at_once")
async def test_an_answer_to_a_nudge_nobody_sent_is_a_breach(tmp_path: Path) -> None:
    """A handler that writes {"returned": [...]} for the job waiting behind it would have that
    job run twice — elsewhere, and after it in the same worker. The worker is killed instead,
    and as nothing it wrote is trusted after that, the jobs it had fail (they may have
    started) rather than run again: the job behind runs at most once."""
    b = await started_backend(tmp_path, rescue_s=60.0)
    ran = tmp_path / "ran"
    try:
        victim = handler("count", [str(ran)])
        forger = handler("forge_returned", [f"{victim.task_id}-1"])
        first = asyncio.create_task(run(b, forger))
        second = asyncio.create_task(run(b, victim))
        forged, counted = await first, await second
    finally:
        await b.close()
    assert not forged.ok
    assert "not this job's reply" in (forged.error or "")
    assert not counted.ok
    assert (ran.read_text() if ran.exists() else "") in ("", "ran\n")  # never twice


class RawWorker:
    """A handler worker process on its own, driven through its pipes as the executor would."""

    def __init__(self, tmp_path: Path) -> None:
        job_r, self.jobs = os.pipe()
        reply_r, reply_w = os.pipe()
        argv = [sys.executable, "-P", str(WORKER), str(tmp_path / "out")]
        self.proc = subprocess.Popen(argv, stdin=job_r, stdout=reply_w, cwd=REPO)
        os.close(job_r)
        os.close(reply_w)
        self.replies = reply_r
        self.buffer = b""

    def send(self, *jobs: tuple[str, str, Any]) -> None:
        """Jobs (id, handler in tests.handlers, args), in one write."""
        lines = [
            json.dumps({"job": stem, "handler": f"tests.handlers:{name}", "args": args}) + "\n"
            for stem, name, args in jobs
        ]
        os.write(self.jobs, "".join(lines).encode())

    def reply(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.replies], [], [], 10)
            assert ready, "no reply within 10 s"
            self.buffer += os.read(self.replies, 65536)
        line, self.buffer = self.buffer.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        for fd in (self.jobs, self.replies):
            if fd >= 0:
                os.close(fd)


async def test_a_worker_answers_a_nudge(tmp_path: Path) -> None:
    """The worker protocol alone: jobs sent together run in order, each reply says how long
    its job ran and is written before the next job starts; a nudge (SIGUSR1) gives back what
    has not started."""
    worker = RawWorker(tmp_path)
    marker = tmp_path / "marker"
    try:
        assert worker.reply() == {"ready": True}
        worker.send(("a", "add", [1, 2]), ("b", "add", [3, 4]))
        a, b = worker.reply(), worker.reply()
        assert (a["job"], a["result"], b["job"], b["result"]) == ("a", 3, "b", 7)
        assert 0 <= a["ran"] < 1
        worker.send(("c", "sleep", [60, str(marker)]), ("d", "add", [1, 1]))
        await until(marker.exists, "job c to start")
        worker.proc.send_signal(signal.SIGUSR1)
        assert worker.reply() == {"returned": ["d"]}  # while c runs, at once
    finally:
        worker.close()


async def test_an_idle_worker_answers_a_nudge(tmp_path: Path) -> None:
    worker = RawWorker(tmp_path)
    try:
        assert worker.reply() == {"ready": True}
        worker.proc.send_signal(signal.SIGUSR1)
        assert worker.reply() == {"returned": []}
        os.close(worker.jobs)  # end of the jobs: the worker exits by itself
        worker.jobs = -1
        assert worker.proc.wait(timeout=10) == 0
    finally:
        worker.close()


async def test_close_stops_everything(tmp_path: Path) -> None:
    b = LocalBackend(1, tmp_path / "state")
    await b.start()
    marker, pidfile = tmp_path / "marker", tmp_path / "sleep.pid"
    runs = [
        asyncio.create_task(run(b, handler("sleep", [60, str(marker)]))),
        asyncio.create_task(run(b, handler("add", [1, 2]))),  # waits for the only worker
        asyncio.create_task(run(b, command(f"sleep 100 & echo $! > {pidfile}; wait"))),
    ]
    await until(lambda: marker.exists() and read_pid(pidfile), "the attempts to start")
    async with asyncio.timeout(10):
        await b.close()
    assert all(r.result().stopped for r in runs)
    assert (await run(b, handler("add", [1, 2]))).stopped
    assert records(b.state_dir) == []
    assert list((b.state_dir / "running").iterdir()) == []


async def test_workers_that_exit_on_close_are_not_killed_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's reply pipe ends a moment before its exit is reported: that is a worker
    exiting, not one that closed its pipe and lives on, and it is not killed (its shim,
    gone by then, would refuse the order)."""
    b = LocalBackend(8, tmp_path / "state", warm_workers=8)
    await b.start()
    outcomes = await asyncio.gather(*(run(b, handler("add", [i, 1])) for i in range(8)))
    assert all(o.ok for o in outcomes)
    await b.close()
    assert not [r for r in caplog.records if "did not take" in r.getMessage()]


async def test_one_backend_per_state_dir(backend: LocalBackend) -> None:
    with pytest.raises(RuntimeError, match="in use by another executor"):
        await LocalBackend(1, backend.state_dir).start()


async def test_noop_handler_overhead(tmp_path: Path) -> None:
    """Not asserted (timing is the machine's): printed for `-s` runs.

    Seen on the 2-vCPU dev VM: about 130-150 µs per no-op round trip through an idle worker
    (run() to Outcome, including the running-record link/unlink), on asyncio and on uvloop.
    """
    b = LocalBackend(1, tmp_path / "state")
    await b.start()
    try:
        job = HandlerJob(handler="tests.handlers:noop")
        for _ in range(50):
            await run(b, Launch(uuid4(), 1, job, None))
        n = 500
        started = time.perf_counter()
        for _ in range(n):
            assert (await b.run(Launch(uuid4(), 1, job, None))).ok
        per_call = (time.perf_counter() - started) / n
    finally:
        await b.close()
    print(f"no-op handler round trip: {per_call * 1e6:.0f} µs")  # noqa: T201


# --- orphans ---------------------------------------------------------------------------------

EXECUTOR = """
import asyncio, sys, uuid
from pathlib import Path

import uvloop

from services.executor.backends import Launch
from services.executor.backends.local import LocalBackend
from shared.models import CommandJob, HandlerJob

async def main() -> None:
    backend = LocalBackend(1, Path(sys.argv[1]))
    await backend.start()
    task_id = uuid.UUID(sys.argv[2])
    sleeper = HandlerJob(handler="tests.handlers:spawn_sleeper", args=[sys.argv[4]])
    await asyncio.gather(
        backend.run(Launch(task_id, 1, CommandJob(argv=["sh", "-c", sys.argv[3]]), None)),
        backend.run(Launch(task_id, 2, sleeper, None)),
    )

uvloop.run(main())
"""


def start_executor(tmp_path: Path, *args: object) -> subprocess.Popen[bytes]:
    """The EXECUTOR script as a process of its own, its output in tmp_path/executor.out."""
    with (tmp_path / "executor.out").open("wb") as out:
        argv = [sys.executable, "-c", EXECUTOR, *map(str, args)]
        return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def warden_tree(root: int) -> list[int]:
    """The pids of the warden and its shims below process `root` (python processes)."""
    out = []
    for pid in _descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"services.executor.warden" in argv:
            out.append(pid)
    return out


async def start_two_attempts(tmp_path: Path, script: str) -> tuple[Any, UUID, list[int]]:
    state, task_id = tmp_path / "state", uuid4()
    executor = start_executor(tmp_path, state, task_id, script, tmp_path / "handler.pid")

    def started() -> bool:
        if executor.poll() is not None:
            raise AssertionError((tmp_path / "executor.out").read_text())
        both = read_pid(tmp_path / "command.pid") and read_pid(tmp_path / "handler.pid")
        # a process may write its pid before the executor has written its record
        return bool(both) and bool(records(state)) and bool(worker_records(state))

    await until(started, "the executor to start and record both attempts", timeout=30)
    leaders = [json.loads(p.read_text())["pid"] for p in records(state) + worker_records(state)]
    assert len(leaders) == 2
    return executor, task_id, leaders


async def test_a_killed_executor_takes_its_whole_trees_with_it(tmp_path: Path) -> None:
    """SIGKILL the executor: its warden sees it go and every shim kills its tree — the
    children, what they left in their groups, and a daemon that escaped with setsid."""
    command_pid, escaped_pid = tmp_path / "command.pid", tmp_path / "escaped.pid"
    script = (
        f"setsid sh -c 'echo $$ > {escaped_pid}; exec sleep 60' & "
        f"sleep 60 & echo $! > {command_pid}; wait"
    )
    executor, _, leaders = await start_two_attempts(tmp_path, script)
    await until(lambda: read_pid(escaped_pid), "the escaped daemon to start")
    others = [read_pid(command_pid), read_pid(tmp_path / "handler.pid"), read_pid(escaped_pid)]
    executor.kill()
    executor.wait(timeout=10)
    everything = [*leaders, *(p for p in others if p)]
    await until(lambda: all(gone(p) for p in everything), "every process of both attempts to end")


async def test_orphans_of_an_executor_killed_with_its_warden_are_reaped(tmp_path: Path) -> None:
    """SIGKILL the executor, its warden and its shims at once: the attempts' leaders die
    (parent-death signal), what they left in their process groups is killed by the next
    executor on this state_dir, from its records: the command attempt's, and the handler
    worker's (a handler job has no record of its own)."""
    command_pid = tmp_path / "command.pid"
    script = f"sleep 60 & echo $! > {command_pid}; wait"
    executor, task_id, leaders = await start_two_attempts(tmp_path, script)
    try:
        # all at once: stopped first, so that the warden cannot see the executor die and
        # kill the trees itself (it would, given a moment: that is its job) before its turn
        together = [executor.pid, *warden_tree(executor.pid)]
        for pid in together:
            os.kill(pid, signal.SIGSTOP)
        for pid in together:
            os.kill(pid, signal.SIGKILL)
    finally:
        executor.wait(timeout=10)
    await until(lambda: all(gone(pid) for pid in leaders), "PDEATHSIG to kill the children")
    grandchildren = [read_pid(command_pid), read_pid(tmp_path / "handler.pid")]
    assert not any(gone(pid) for pid in grandchildren if pid)

    old_workers = worker_records(tmp_path / "state")
    b = LocalBackend(1, tmp_path / "state")
    await b.start()
    try:
        assert b.reaped == [(task_id, 1)]  # the command; the handler's worker is not named
        await until(lambda: all(gone(p) for p in grandchildren if p), "the orphans to be reaped")
        assert records(tmp_path / "state") == []
        assert not set(old_workers) & set(worker_records(tmp_path / "state"))
    finally:
        await b.close()


def leftover(state: Path, key: tuple[UUID, int], start_time_offset: int) -> subprocess.Popen[bytes]:
    """A `sleep` in its own session, and a record of it as an attempt a dead executor left."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stat = Path(f"/proc/{proc.pid}/stat").read_bytes()
    record = {
        "pid": proc.pid,
        "pgid": proc.pid,
        "start_time": int(stat[stat.rindex(b")") + 2 :].split()[19]) + start_time_offset,
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
    }
    (state / "running").mkdir(parents=True)
    (state / "running" / f"{key[0]}-{key[1]}.json").write_text(json.dumps(record))
    return proc


@pytest.mark.parametrize("same_process", [True, False])
async def test_reaping_checks_the_start_time(tmp_path: Path, same_process: bool) -> None:
    state, key = tmp_path / "state", (UUID(int=7), 4)
    proc = leftover(state, key, 0 if same_process else -1)
    try:
        b = LocalBackend(0, state)
        await b.start()
        await b.close()
        assert b.reaped == [key]
        assert records(state) == []
        if same_process:
            assert proc.wait(timeout=10) == -signal.SIGKILL
        else:
            assert proc.poll() is None  # a later process that got the pid: left alone
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def test_a_dead_executors_handler_worker_group_is_reaped(tmp_path: Path) -> None:
    """A handler job has no record of its own: its worker's record names the group that what
    the job started lives in, and the next executor on the state_dir kills it, busy or idle."""
    state = tmp_path / "state"
    proc = leftover(state, (UUID(int=7), 4), 0)
    try:
        (state / "running" / f"{UUID(int=7)}-4.json").rename(state / "running" / "w1.worker")
        b = LocalBackend(0, state)
        await b.start()
        await b.close()
        assert b.reaped == []  # no attempt named: the worker's job is not known here
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert worker_records(state) == []
    finally:
        proc.kill()
        proc.wait(timeout=10)


# --- inputs and declared outputs (workflow results flowing downstream) ---------------------


async def test_a_command_declares_its_output_in_sked_output(backend: LocalBackend) -> None:
    script = 'cat "$SKED_INPUTS" > /dev/null && printf \'{"rows": 3}\' > "$SKED_OUTPUT"'
    launch = Launch(uuid4(), 1, CommandJob(argv=["sh", "-c", script]), None, inputs={"up": 1})
    outcome = await run(backend, launch)
    assert outcome.ok, outcome.error
    assert outcome.result == {"exit_code": 0, "output": {"rows": 3}}


async def test_a_command_reads_its_inputs_from_the_file_in_sked_inputs(
    backend: LocalBackend,
) -> None:
    launch = Launch(
        uuid4(),
        1,
        CommandJob(argv=["sh", "-c", 'cp "$SKED_INPUTS" "$SKED_OUTPUT"']),
        None,
        inputs={"extract": {"rows": 3}, "backup": None},
    )
    outcome = await run(backend, launch)
    assert outcome.result == {"exit_code": 0, "output": {"extract": {"rows": 3}, "backup": None}}
    assert not list((backend.state_dir / "io").iterdir()), "the attempt's files were not removed"


async def test_a_command_without_declared_output_or_inputs(backend: LocalBackend) -> None:
    outcome = await run(backend, command('test -z "$SKED_INPUTS" && test -n "$SKED_OUTPUT"'))
    assert (outcome.ok, outcome.result) == (True, {"exit_code": 0})


async def test_declared_output_that_is_not_json_fails_the_attempt(backend: LocalBackend) -> None:
    outcome = await run(backend, command('echo "not json" > "$SKED_OUTPUT"'))
    assert not outcome.ok
    assert outcome.error is not None
    assert outcome.error.startswith("declared output in $SKED_OUTPUT is not JSON sked takes")


async def test_a_failed_command_declares_nothing(backend: LocalBackend) -> None:
    outcome = await run(backend, command('echo 1 > "$SKED_OUTPUT"; exit 3'))
    assert (outcome.ok, outcome.result, outcome.error) == (False, {"exit_code": 3}, "exit code 3")


@pytest.mark.parametrize(
    ("name", "args", "result"),
    [
        ("total", {"base": 1}, 6),  # asks for `inputs` by name
        ("sees_inputs", None, {"inputs": {"a": 2, "b": 3}}),
        ("echo", {"x": 1}, {"x": 1}),  # **kwargs does not count: it never gets `inputs`
        ("add", [2, 2], 4),
    ],
)
async def test_a_handler_gets_inputs_when_it_names_them(
    backend: LocalBackend, name: str, args: Any, result: Any
) -> None:
    launch = Launch(
        uuid4(),
        1,
        HandlerJob(handler=f"tests.handlers:{name}", args=args),
        None,
        inputs={"a": 2, "b": 3},
    )
    outcome = await run(backend, launch)
    assert (outcome.ok, outcome.result) == (True, result), outcome.error


def workers_of(state: Path) -> int:
    """Live handler workers whose output file is under `state`."""
    count = 0
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = any(str(state).encode() in a for a in argv)
        if ours and any(a.endswith(b"local/worker.py") for a in argv):
            count += 0 if gone(int(proc.name)) else 1
    return count


async def test_only_the_warm_workers_start_with_the_backend(tmp_path: Path) -> None:
    state = tmp_path / "state"
    b = LocalBackend(3, state, warm_workers=1)
    await b.start()
    try:
        assert workers_of(state) == 1
        assert (await run(b, command("true"))).ok  # commands need no worker
        assert workers_of(state) == 1
        markers = [tmp_path / f"m{i}" for i in range(3)]
        jobs = [asyncio.create_task(run(b, handler("sleep", [60, str(m)]))) for m in markers]
        await until(lambda: all(m.exists() for m in markers), "three handlers to run at once")
        assert workers_of(state) == 3
    finally:
        await b.close()
    assert all(job.result().stopped for job in jobs)
    await until(lambda: workers_of(state) == 0, "the workers to end")


# --- leases, trees, environment -------------------------------------------------------------


def states(pids: list[int]) -> set[str]:
    """The /proc states of the live ones among `pids` (R, S, T, ...)."""
    out = set()
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        out.add(raw[raw.rindex(b")") + 2 :].split()[0].decode())
    return out - {"Z"}


async def test_an_unrenewed_lease_freezes_the_tree_and_a_renewal_thaws_it(
    backend: LocalBackend, tmp_path: Path
) -> None:
    ticks, child = tmp_path / "ticks", tmp_path / "child.pid"
    script = (
        f"(while :; do echo x >> {ticks}; sleep 0.05; done) & echo $! > {child}; "
        f"while :; do echo y >> {ticks}; sleep 0.05; done"
    )
    launch = replace(command(script), lease_s=0.5)
    key = (launch.task_id, launch.attempt)
    job = asyncio.create_task(backend.run(launch))
    try:
        await until(lambda: backend.frozen(key), "the lease to lapse and the tree to freeze")
        pids = [json.loads(p.read_text())["pid"] for p in records(backend.state_dir)]
        pids.append(read_pid(child) or 0)
        assert states(pids) == {"T"}, states(pids)
        size = ticks.stat().st_size
        await asyncio.sleep(0.3)
        assert ticks.stat().st_size == size, "a frozen tree kept writing"
        backend.renew(key, 30.0)
        await until(lambda: not backend.frozen(key), "the renewal to thaw it")
        await until(lambda: ticks.stat().st_size > size, "the tree to run again")
        assert "T" not in states(pids)
    finally:
        await backend.stop_task(launch.task_id, launch.attempt)
    assert (await job).stopped


async def test_a_renewal_that_comes_too_late_does_not_thaw_the_tree(
    backend: LocalBackend, tmp_path: Path
) -> None:
    """A renewal whose lease is over by the time it is applied (its statement sent before the
    executor froze, its reply read after it woke: seconds <= 0) must leave a frozen tree
    frozen, as its successor may run elsewhere by now. It thawed it until the shim's next
    tick froze it again: the fault suite once sampled an attempt running beside its
    successor for 0.2 s so. A renewal with time left still thaws it."""
    ticks = tmp_path / "ticks"
    launch = replace(command(f"while :; do echo x >> {ticks}; sleep 0.02; done"), lease_s=0.5)
    key = (launch.task_id, launch.attempt)
    job = asyncio.create_task(backend.run(launch))
    try:
        await until(lambda: backend.frozen(key), "the lease to lapse and the tree to freeze")
        size = ticks.stat().st_size
        for late in (0.0, -3.0):
            backend.renew(key, late)
            await asyncio.sleep(0.3)
            assert backend.frozen(key)
            assert ticks.stat().st_size == size, "a renewal too late let the tree run"
        backend.renew(key, 30.0)
        await until(lambda: ticks.stat().st_size > size, "a renewal in time to thaw it")
    finally:
        await backend.stop_task(launch.task_id, launch.attempt)
    assert (await job).stopped


async def test_a_frozen_tree_is_stopped_without_running_again(
    backend: LocalBackend, tmp_path: Path
) -> None:
    """A tree frozen because its lease lapsed may already have a successor running elsewhere:
    stopping it (the task moved on, the executor shuts down) kills it as it stands. Thawing
    it for a graceful SIGTERM would run it beside its successor for the grace — here, a
    script that ignores SIGTERM would write on for the whole of it."""
    ticks = tmp_path / "ticks"
    script = f"trap '' TERM; while :; do echo x >> {ticks}; sleep 0.02; done"
    launch = replace(command(script), lease_s=0.5)
    key = (launch.task_id, launch.attempt)
    job = asyncio.create_task(backend.run(launch))
    await until(lambda: backend.frozen(key), "the lease to lapse and the tree to freeze")
    size = ticks.stat().st_size
    await backend.stop_task(launch.task_id, launch.attempt)
    outcome = await job
    assert outcome.stopped
    assert ticks.stat().st_size == size, "the frozen tree ran again on its way out"


async def test_a_tree_frozen_too_long_is_killed(tmp_path: Path) -> None:
    b = LocalBackend(1, tmp_path / "state", freeze_max_s=0.3)
    await b.start()
    try:
        outcome = await run(b, replace(command("sleep 60"), lease_s=0.2))
    finally:
        await b.close()
    assert not outcome.ok
    assert outcome.error is not None
    assert outcome.error.startswith("lease lapsed: frozen for 0.3 s"), outcome.error


async def test_a_handler_worker_is_frozen_with_its_attempt(
    backend: LocalBackend, tmp_path: Path
) -> None:
    marker = tmp_path / "m"
    launch = replace(handler("sleep", [60, str(marker)]), lease_s=0.3)
    key = (launch.task_id, launch.attempt)
    job = asyncio.create_task(backend.run(launch))
    try:
        await until(lambda: backend.frozen(key), "the handler's worker to freeze")
        backend.renew(key, 30.0)
        await until(lambda: not backend.frozen(key), "the renewal to thaw it")
    finally:
        await backend.stop_task(launch.task_id, launch.attempt)
    assert (await job).stopped


async def test_a_handler_job_started_late_keeps_its_leases_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease a claim brought ends when it ends, however long the job then waited for its
    worker (here one being started): the worker's shim is told that end, not the lease's
    length counted again from the moment the job reached the worker."""
    from services.executor.backends.local import process

    b = LocalBackend(1, tmp_path / "state", warm_workers=0)
    await b.start()
    spawn = b._pool.spawn

    async def slow_spawn() -> workers.Worker:
        await asyncio.sleep(0.5)  # a busy host starting the slot's first worker
        return await spawn()

    told: list[float] = []  # the deadlines the shim was told, on the monotonic clock
    send = process.Proc._send

    def record(self: process.Proc, line: str) -> None:
        word, _, seconds = line.partition(" ")
        if word == "renew":
            told.append(time.monotonic() + float(seconds))
        send(self, line)

    monkeypatch.setattr(b._pool, "spawn", slow_spawn)
    monkeypatch.setattr(process.Proc, "_send", record)
    try:
        lease_ends = time.monotonic() + 5.0
        outcome = await run(b, replace(handler("pid"), lease_s=5.0))
        assert outcome.ok, outcome.error
        assert told, "the worker's shim was never told the job's lease"
        assert max(told) <= lease_ends + 0.05, f"told {max(told) - lease_ends:.3f} s too late"
    finally:
        await b.close()


async def test_an_idle_workers_lease_is_dropped_before_it_lapses(tmp_path: Path) -> None:
    """A handler worker keeps its last job's lease while idle (its next job renews it anyway)
    but drops it shortly before it would run out: an idle worker is never frozen."""
    b = LocalBackend(1, tmp_path / "state")
    await b.start()
    try:
        first = await run(b, replace(handler("pid"), lease_s=0.8))
        assert first.ok, first.error
        await asyncio.sleep(1.5)  # past the lease: it would be frozen had it kept it
        assert states([first.result]) <= {"S", "R"}, states([first.result])
        again = await run(b, replace(handler("pid"), lease_s=0.8))
        assert again.result == first.result  # the same worker, alive and not frozen
    finally:
        await b.close()


async def test_what_a_command_leaves_behind_ends_with_it(
    backend: LocalBackend, tmp_path: Path
) -> None:
    """A daemon that escaped into its own session (setsid) and a background job in the
    command's group: both end when the command does, not later."""
    escaped, background = tmp_path / "escaped.pid", tmp_path / "bg.pid"
    script = (
        f"setsid sh -c 'echo $$ > {escaped}; exec sleep 60' & "
        f"sleep 60 & echo $! > {background}; "
        f"while [ ! -s {escaped} ]; do sleep 0.01; done"
    )
    outcome = await run(backend, command(script))
    assert outcome.ok, outcome.error
    pids = [read_pid(escaped), read_pid(background)]
    assert all(pids)
    await until(lambda: all(gone(p) for p in pids if p), "the leftovers to be killed")


async def test_tasks_get_an_allowlisted_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing of the executor's environment but PATH, HOME, LANG, TZ and the names passed
    on purpose reaches a command or a handler."""
    monkeypatch.setenv("SKED_DATABASE_URL", "postgresql://secret@db/prod")
    monkeypatch.setenv("SKED_HEARTBEAT_SECRET", "s3cret-s3cret-s3cret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    monkeypatch.setenv("PASSED_ON", "yes")
    monkeypatch.setenv("LANG", "C.UTF-8")
    b = LocalBackend(1, tmp_path / "state", env_pass=["PASSED_ON"])
    await b.start()
    try:
        shell = await run(b, Launch(uuid4(), 1, CommandJob(argv=["env"], env={"MINE": "1"}), None))
        py = await run(b, handler("whole_environ"))
    finally:
        await b.close()
    seen = dict(line.split("=", 1) for line in shell.log_tail.splitlines() if "=" in line)
    for env in (seen, py.result):
        assert "SKED_DATABASE_URL" not in env
        assert "SKED_HEARTBEAT_SECRET" not in env
        assert "AWS_SECRET_ACCESS_KEY" not in env
        assert env["PASSED_ON"] == "yes"
        assert env["LANG"] == "C.UTF-8"
    allowed = {"PATH", "HOME", "LANG", "TZ", "PASSED_ON", "MINE", "SKED_TASK_ID", "SKED_ATTEMPT"}
    allowed |= {"SKED_OUTPUT", "PWD", "SHLVL", "_"}  # env's own, and the shell's
    assert set(seen) <= allowed, set(seen) - allowed
    assert "MINE" not in py.result


# --- shims: kept for the next attempt, carrying nothing over ---------------------------------


def parent_of(outcome: Outcome) -> int:
    """The pid a command (`echo $PPID; ...`) printed first: its shim's."""
    return int(outcome.log_tail.split()[0])


async def test_a_shim_serves_attempt_after_attempt(backend: LocalBackend, tmp_path: Path) -> None:
    """Attempts one after another run under one shim (a fork per attempt saved); what the
    first left running is gone before the next starts, each starts with only its standard
    descriptors, and the shim holds no more descriptors after many attempts than after one."""
    escaped = tmp_path / "escaped.pid"
    first = await run(
        backend,
        command(
            f"echo $PPID; setsid sh -c 'echo $$ > {escaped}; exec sleep 60' & "
            f"while [ ! -s {escaped} ]; do sleep 0.01; done"
        ),
    )
    assert first.ok, first
    shim, daemon = parent_of(first), read_pid(escaped)
    assert daemon, "the escaped daemon never started"
    assert gone(daemon), "the escaped daemon outlived its attempt"
    held = sorted(os.listdir(f"/proc/{shim}/fd"))
    for _ in range(5):
        outcome = await run(backend, command("echo $PPID; ls /proc/$$/fd"))
        assert outcome.ok, outcome
        assert parent_of(outcome) == shim, "an idle shim was there, yet another was forked"
        assert sorted(outcome.log_tail.split()[1:]) == ["0", "1", "2"], outcome.log_tail
    assert sorted(os.listdir(f"/proc/{shim}/fd")) == held, "the shim leaks a descriptor a run"


async def test_an_idle_shim_that_died_is_replaced(backend: LocalBackend) -> None:
    shim = parent_of(await run(backend, command("echo $PPID")))
    os.kill(shim, signal.SIGKILL)  # idle: its attempt has ended
    await until(lambda: gone(shim), "the idle shim to die")
    again = await run(backend, command("echo $PPID"))
    assert again.ok, again
    assert parent_of(again) != shim


async def test_shims_running_side_by_side_are_distinct(backend: LocalBackend) -> None:
    both = await asyncio.gather(*(run(backend, command("echo $PPID; sleep 0.3")) for _ in "ab"))
    assert all(o.ok for o in both), both
    assert len({parent_of(o) for o in both}) == 2


async def test_retention_prunes_ended_attempts_logs(backend: LocalBackend) -> None:
    """Each attempt leaves its log file; retention deletes those last written before the
    cutoff, except an attempt's still held here (a silent one may be that old), and nothing
    that is not an attempt's log."""
    old, recent, held = (command(f"echo {name}") for name in ("old", "recent", "held"))
    for launch in (old, recent, held):
        assert (await run(backend, launch)).ok
    logs = backend.state_dir / "logs"
    names = {f"{launch.task_id}-{launch.attempt}.log": launch for launch in (old, recent, held)}
    assert set(names) <= {p.name for p in logs.iterdir()}
    stray = logs / "notes.txt"
    stray.write_text("an operator's")
    two_hours_ago = time.time() - 7200
    for name in (f"{old.task_id}-1.log", f"{held.task_id}-1.log", "notes.txt"):
        os.utime(logs / name, (two_hours_ago, two_hours_ago))

    assert await backend.prune(3600, {(held.task_id, held.attempt)}) == 1
    left = {p.name for p in logs.iterdir()}
    assert f"{old.task_id}-1.log" not in left
    assert {f"{recent.task_id}-1.log", f"{held.task_id}-1.log", "notes.txt"} <= left
    assert await backend.prune(3600, set()) == 1  # held no longer: its old log goes too


async def test_a_job_behind_a_lapsed_one_neither_thaws_nor_holds_its_worker(
    tmp_path: Path,
) -> None:
    """A handler worker runs one job with others waiting behind it. Its process may run only
    while the job it runs holds its lease: a job behind it with a later lease (given to it,
    or renewed after its executor woke from a freeze) must not keep the worker from freezing
    when the running job's lease lapses, nor thaw it after — the running job's successor may
    be running elsewhere. Before, either did: the worker took the latest lease it was told."""
    b = await started_backend(tmp_path, slots=1, rescue_s=60.0)
    ticks = tmp_path / "ticks"
    running = replace(handler("tick", [str(ticks), 10.0]), lease_s=0.8)
    behind = replace(handler("noop"), lease_s=30.0)
    running_key = (running.task_id, running.attempt)
    jobs = [asyncio.create_task(b.run(running))]
    try:
        await until(lambda: ticks.exists() and ticks.stat().st_size > 0, "the first job to run")
        jobs.append(asyncio.create_task(b.run(behind)))  # waits at the one worker
        await until(lambda: b.frozen(running_key), "its lease to lapse")
        size = ticks.stat().st_size
        b.renew((behind.task_id, behind.attempt), 30.0)
        await asyncio.sleep(0.3)
        assert ticks.stat().st_size == size, "a renewal of the job behind thawed the worker"
        b.renew(running_key, 30.0)  # its own lease, renewed in time: it runs on
        await until(lambda: ticks.stat().st_size > size, "the running job's renewal to thaw it")
    finally:
        for launch in (running, behind):
            await b.stop_task(launch.task_id, launch.attempt)
        await asyncio.gather(*jobs)
        await b.close()
