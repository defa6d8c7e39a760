"""The local backend: runs one attempt of a task as a local process (a command's own process
group, or a job in a pool of long-lived handler workers), and records each under state_dir/running
so that the next executor on this state_dir kills what a crashed one left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple
from uuid import UUID, uuid4

from services.executor.worker import MAX_REPLY_BYTES, READY, describe
from shared.models import CommandJob, HandlerJob

log = logging.getLogger(__name__)

Key = tuple[UUID, int]
STOP_GRACE_S = 1.0  # between SIGTERM and SIGKILL
WORKER_START_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Launch:
    task_id: UUID
    attempt: int
    job: CommandJob | HandlerJob
    timeout_s: float | None  # run timeout; None = no limit
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for the task
    inputs: Any = None  # a workflow task's inputs from its upstreams (None: none)


@dataclass(frozen=True)
class Outcome:
    ok: bool  # exit code 0, or the handler returned normally
    result: Any  # handler: its JSON value; command: {"exit_code": n[, "output": declared]}
    error: str | None  # one line
    timed_out: bool
    stopped: bool  # ended by stop_task() or close()
    log_tail: str  # the end of the attempt's combined stdout and stderr

    @classmethod
    def failed(cls, error: str, log_tail: str = "", *, timed_out: bool = False) -> Outcome:
        return cls(False, None, error, timed_out, False, log_tail)

    @classmethod
    def halted(cls, log_tail: str = "") -> Outcome:
        return cls(False, None, "stopped", False, True, log_tail)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _tail(path: Path, size: int) -> str:
    try:
        with path.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - size))
            data = f.read(size)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def _with_output(outcome: Outcome, path: Path) -> Outcome:
    """A command that exited 0 and wrote JSON to $SKED_OUTPUT declared that as its output: it
    joins the result (and goes downstream). Output that is not JSON fails the attempt."""
    if not outcome.ok:
        return outcome
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return outcome  # declared nothing
    if size == 0:
        return outcome
    if size > MAX_REPLY_BYTES:
        error = f"declared output too large: {size} bytes in $SKED_OUTPUT"
        return Outcome.failed(error, outcome.log_tail)
    try:
        output = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        error = f"declared output in $SKED_OUTPUT is not JSON: {describe(exc)}"
        return Outcome.failed(error, outcome.log_tail)
    return replace(outcome, result={**outcome.result, "output": output})


def _task_env(launch: Launch) -> dict[str, str]:
    return {"SKED_TASK_ID": str(launch.task_id), "SKED_ATTEMPT": str(launch.attempt)}


# --- process groups ------------------------------------------------------------------------


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return prctl


def _die_with_parent(parent: int) -> None:
    """Run in the child between fork and exec: have it SIGKILLed when the executor dies.

    The kernel sends it when the forking *thread* ends, so the backend must run on a thread that
    lives as long as the executor (the event loop's). Grandchildren do not inherit it; the
    records in state_dir/running cover those.
    """
    prctl = _prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the executor died before prctl took effect
            os._exit(1)


def _spawn_options() -> dict[str, Any]:
    # Its own session: a stop signals the whole group, and a terminal's Ctrl-C reaches no task.
    _prctl()  # load libc here, not in the forked child
    return {
        "start_new_session": True,
        "preexec_fn": functools.partial(_die_with_parent, os.getpid()),
    }


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _kill_group(pgid: int, exited: asyncio.Future[int]) -> None:
    """SIGTERM the group, SIGKILL it after a grace period; return once its leader has exited.

    The SIGKILL goes out even when the leader is already gone: members that ignored SIGTERM, or
    background jobs a task left behind, must not outlive their attempt.
    """
    if not exited.done():
        _signal_group(pgid, signal.SIGTERM)
        await asyncio.wait({exited}, timeout=STOP_GRACE_S)
    _signal_group(pgid, signal.SIGKILL)
    await asyncio.wait({exited})  # not `await exited`: our cancellation must not cancel it


class _Stat(NamedTuple):
    pgid: int
    start_time: int


def _stat(pid: int) -> _Stat | None:
    """From /proc/<pid>/stat: the process group, and the start time (field 22) that tells a
    process from a later one given the same pid. None if there is no such process (or /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its last ")".
    fields = raw[raw.rindex(b")") + 2 :].split()
    return _Stat(int(fields[2]), int(fields[19]))


def _start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat.start_time


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


# --- records of attempts in flight -----------------------------------------------------------


class _Records:
    """state_dir/running: `<task_id>-<attempt>.json` per attempt in flight, naming the process
    group to kill should this executor die; `<name>.worker` per handler worker."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.boot_id = _boot_id()

    def _path(self, key: Key) -> Path:
        return self.root / f"{key[0]}-{key[1]}.json"

    def _write(self, path: Path, pid: int, start_time: int | None) -> None:
        record = {
            "pid": pid,
            "pgid": pid,  # a session leader: its pid names its group
            "start_time": start_time,
            "boot_id": self.boot_id,
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)  # a crash mid-write leaves a stray .tmp, never a torn record

    def add(self, key: Key, pid: int, start_time: int | None) -> None:
        self._write(self._path(key), pid, start_time)

    def add_worker(self, name: str, pid: int, start_time: int | None) -> Path:
        path = self.root / f"{name}.worker"
        self._write(path, pid, start_time)
        return path

    def link(self, key: Key, worker_record: Path) -> None:
        """Record a handler attempt as a hard link to its worker's record.

        Creating a file (an inode) cost 0.1-0.3 ms on the test machine's ext4, most of a no-op
        handler's round trip; a link costs about 10 µs.
        """
        path = self._path(key)
        try:
            os.link(worker_record, path)
        except FileExistsError:
            path.unlink()
            os.link(worker_record, path)
        except OSError:  # a file system without hard links
            shutil.copyfile(worker_record, path)

    def remove(self, key: Key) -> None:
        self._path(key).unlink(missing_ok=True)

    def reap(self) -> list[Key]:
        """Kill what the attempts recorded by a dead executor left running; drop the records."""
        reaped = []
        for path in sorted(self.root.iterdir()):
            if path.suffix == ".json":
                try:
                    task_id, _, attempt = path.stem.rpartition("-")
                    key = (UUID(task_id), int(attempt))
                    record = json.loads(path.read_text())
                    killed = self._kill_leftover(record)
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("dropping unreadable attempt record %s: %s", path, exc)
                else:
                    log.warning(
                        "reaped attempt %s/%s left running by a previous executor: %s",
                        *key,
                        f"killed process group {record['pgid']}" if killed else "it was gone",
                        extra={"task_id": key[0], "attempt": key[1]},
                    )
                    reaped.append(key)
            # Worker records and stray .tmp files: an idle worker dies with its executor.
            path.unlink(missing_ok=True)
        return reaped

    def _kill_leftover(self, record: dict[str, Any]) -> bool:
        pid, pgid, started = int(record["pid"]), int(record["pgid"]), record["start_time"]
        if started is None or self.boot_id is None or record.get("boot_id") != self.boot_id:
            return False  # no way to tell it from a later process, or rebooted since
        leader = _stat(pid)
        if leader is not None:
            if leader.start_time != started:
                return False  # the pid was reused, so our group is gone
        elif not any(
            (member := _stat(int(name))) is not None
            and member.pgid == pgid
            and member.start_time >= started
            for name in os.listdir("/proc")
            if name.isdigit()
        ):
            # The leader died (PDEATHSIG) but members may live on; and the kernel never reissues
            # a pid still in use as a group id, so members found here are our group's.
            return False
        _signal_group(pgid, signal.SIGKILL)
        return True


# --- handler workers -------------------------------------------------------------------------


class _Undelivered(Exception):
    """The worker was gone before it could take the job: safe to retry on a fresh one."""


class _Stopped(Exception):
    """Stopped while waiting for a free handler worker."""


class _Worker:
    """One long-lived `python -m services.executor.worker` process, in its own session.

    What its handlers print goes to its own file, `out`, emptied at the start of each job, and
    is copied to the attempt's log only when there is something: a new file per job would cost
    more than the rest of a no-op handler's round trip.
    """

    def __init__(self, proc: asyncio.subprocess.Process, out: Path) -> None:
        assert proc.stdin is not None
        assert proc.stdout is not None
        self.proc = proc
        self.pid = proc.pid
        self.stdin = proc.stdin
        self.stdout = proc.stdout
        self.out = out
        self.record: Path | None = None
        self.exited = asyncio.ensure_future(proc.wait())
        self._killed = False

    @classmethod
    async def spawn(cls, records: _Records, out_dir: Path) -> _Worker:
        name = uuid4().hex
        out = out_dir / f"{name}.out"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.executor.worker",
            str(out),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            limit=MAX_REPLY_BYTES + 1024,
            **_spawn_options(),
        )
        worker = cls(proc, out)
        try:
            async with asyncio.timeout(WORKER_START_TIMEOUT_S):
                line = await worker.stdout.readline()
            if line != READY:
                await asyncio.wait({worker.exited}, timeout=STOP_GRACE_S)
                raise RuntimeError(f"handler worker did not start: {_exit_text(proc.returncode)}")
            worker.record = records.add_worker(name, proc.pid, _start_time(proc.pid))
        except BaseException:
            await worker.kill()
            raise
        return worker

    async def call(
        self, message: bytes, stop: asyncio.Future[None], timeout: float | None
    ) -> tuple[dict[str, Any] | None, bool]:
        """Send a job and wait for its reply, the worker's death, a stop or the timeout.

        Returns the reply (None if there is none), and whether the worker is gone (died, or broke
        the protocol). Raises _Undelivered if the worker was gone before it took the job.
        """
        if self.exited.done():
            raise _Undelivered
        try:
            self.stdin.write(message)
            # A failed write (EPIPE) only closes the transport; drain() may not raise in time.
            if self.stdin.is_closing():
                raise _Undelivered
            await self.stdin.drain()
        except ConnectionError:
            raise _Undelivered from None
        reply = asyncio.ensure_future(self.stdout.readline())
        try:
            waits: set[asyncio.Future[Any]] = {reply, self.exited, stop}
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if self.exited.done() and not reply.done():
                await asyncio.wait({reply}, timeout=STOP_GRACE_S)  # what it wrote before it went
            if not reply.done():
                return None, self.exited.done()
            answer = _parse_reply(reply)
            return answer, answer is None
        finally:
            reply.cancel()

    async def kill(self) -> None:
        if not self._killed:
            self._killed = True
            self.stdin.close()
            await _kill_group(self.pid, self.exited)
        await asyncio.wait({self.exited})

    async def shutdown(self) -> None:
        self.stdin.close()  # no more jobs: the worker exits by itself
        await asyncio.wait({self.exited}, timeout=STOP_GRACE_S)
        await self.kill()
        self.discard()

    def discard(self) -> None:
        """Remove its files; only once it is dead and its last output copied."""
        self.out.unlink(missing_ok=True)
        if self.record is not None:
            self.record.unlink(missing_ok=True)


def _parse_reply(reply: asyncio.Task[bytes]) -> dict[str, Any] | None:
    if reply.cancelled() or reply.exception() is not None:
        return None  # e.g. a line past the reader's limit
    line = reply.result()
    if not line.endswith(b"\n"):
        return None  # end of file: the worker died mid-job
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) and "ok" in answer else None


# --- the backend -----------------------------------------------------------------------------


class _Run:
    """An attempt in flight here: the task running it, and the future that asks it to stop."""

    def __init__(self) -> None:
        self.stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[Outcome]

    def request_stop(self) -> None:
        if not self.stop.done():
            self.stop.set_result(None)


class LocalBackend:
    """Runs attempts on this machine: commands as process groups, handlers in up to `slots`
    long-lived workers (`warm_workers` started at once, the rest on first use).

    Handlers get a pool of our own because concurrent.futures' process pool cannot kill the one
    job that timed out or was stopped: here that worker's group is killed and a fresh one started.
    """

    def __init__(
        self, slots: int, state_dir: Path, log_tail_bytes: int = 8192, warm_workers: int = 2
    ) -> None:
        self.slots = slots
        # Handler workers started with the executor; the other slots start theirs on their
        # first handler job and keep it. A command-only node with 50 slots does not pay for 50
        # Python processes (seconds of CPU at start), and a handler node pays once per slot.
        self.warm_workers = min(warm_workers, slots)
        self.state_dir = state_dir.absolute()
        self.log_tail_bytes = log_tail_bytes
        self.reaped: list[Key] = []  # attempts a previous executor left running, reaped at start
        self._logs = self.state_dir / "logs"
        self._worker_out = self.state_dir / "workers"
        self._io = self.state_dir / "io"  # per-attempt inputs and declared-output files
        self._records = _Records(self.state_dir / "running")
        self._runs: dict[Key, _Run] = {}
        # One item per slot: its live worker, or None until one is started for it.
        self._idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        for _ in range(slots):
            self._idle.put_nowait(None)
        self._refills: set[asyncio.Task[None]] = set()
        self._lock: int | None = None
        self._started = False
        self._closed = False

    async def start(self) -> None:
        """Reap what a previous executor left running, then start the warm handler workers."""
        for path in (self._logs, self._worker_out, self._io, self._records.root):
            path.mkdir(parents=True, exist_ok=True)
        self._lock = self._take_lock()
        self.reaped = self._records.reap()
        for stale in [*self._worker_out.iterdir(), *self._io.iterdir()]:
            stale.unlink(missing_ok=True)
        self._started = True
        empty = [self._idle.get_nowait() for _ in range(self.warm_workers)]
        spawned = await asyncio.gather(*(self._spawn() for _ in empty), return_exceptions=True)
        for worker in spawned:
            self._idle.put_nowait(worker if isinstance(worker, _Worker) else None)
        for worker in spawned:
            if isinstance(worker, BaseException):
                raise worker

    def _take_lock(self) -> int:
        # Two backends on one state_dir would reap each other's live attempts.
        fd = os.open(self.state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"{self.state_dir} is in use by another executor") from None
        return fd

    async def run(self, launch: Launch) -> Outcome:
        """Run the attempt, or join it if it is already running here; never raises for the task.

        Cancelling a caller does not stop the attempt; stop_task() and close() do.
        """
        if self._closed:
            return Outcome.halted()
        if not self._started:
            raise RuntimeError("LocalBackend.start() was not called")
        key = (launch.task_id, launch.attempt)
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _Run()
            run.task = asyncio.create_task(self._attempt(run, launch))
        return await asyncio.shield(run.task)

    async def stop_task(self, task_id: UUID, attempt: int) -> bool:
        """Kill the attempt if it runs here, and return once it has ended; False if it did not."""
        run = self._runs.get((task_id, attempt))
        if run is None:
            return False
        run.request_stop()
        await asyncio.wait({run.task})
        return True

    def running(self) -> set[Key]:
        return set(self._runs)

    async def close(self) -> None:
        """Stop every attempt still running, then the workers."""
        self._closed = True
        runs = list(self._runs.values())
        for run in runs:
            run.request_stop()
        if runs:
            await asyncio.wait({run.task for run in runs})
        # Not cancelled: a refill in the middle of a kill must finish it. Each is bounded.
        await asyncio.gather(*self._refills)
        workers = [self._idle.get_nowait() for _ in range(self._idle.qsize())]
        await asyncio.gather(*(w.shutdown() for w in workers if w is not None))
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    async def _attempt(self, run: _Run, launch: Launch) -> Outcome:
        key = (launch.task_id, launch.attempt)
        log_path = self._logs / f"{key[0]}-{key[1]}.log"
        inputs_path = self._io / f"{key[0]}-{key[1]}.inputs.json"
        output_path = self._io / f"{key[0]}-{key[1]}.output.json"
        try:
            job = launch.job
            io_env = {}
            if launch.inputs is not None:
                inputs_path.write_text(json.dumps(launch.inputs))
                io_env["SKED_INPUTS"] = str(inputs_path)
            if isinstance(job, CommandJob):
                output_path.unlink(missing_ok=True)
                io_env["SKED_OUTPUT"] = str(output_path)
                launch = replace(launch, env={**launch.env, **io_env})
                outcome = await self._command(run, launch, job, log_path)
                return _with_output(outcome, output_path)
            launch = replace(launch, env={**launch.env, **io_env})
            return await self._handler(run, launch, job, log_path)
        except Exception as exc:
            log.exception(
                "attempt %s/%s: backend failure",
                *key,
                extra={"task_id": key[0], "attempt": key[1]},
            )
            return Outcome.failed(f"executor error: {describe(exc)}", self._tail(log_path))
        finally:
            del self._runs[key]
            inputs_path.unlink(missing_ok=True)
            output_path.unlink(missing_ok=True)

    def _tail(self, log_path: Path) -> str:
        return _tail(log_path, self.log_tail_bytes)

    def _cut_short(self, launch: Launch, stopped: bool, log_tail: str) -> Outcome:
        """The outcome of an attempt that was stopped or ran out of time."""
        if stopped:
            return Outcome.halted(log_tail)
        error = f"timed out after {float(launch.timeout_s or 0)} s"
        return Outcome.failed(error, log_tail, timed_out=True)

    async def _command(self, run: _Run, launch: Launch, job: CommandJob, log_path: Path) -> Outcome:
        key = (launch.task_id, launch.attempt)
        env = {**os.environ, **job.env, **launch.env, **_task_env(launch)}
        try:
            # A file, not a pipe: a chatty task can never block on a reader that is behind.
            with log_path.open("wb") as out:
                proc = await asyncio.create_subprocess_exec(
                    *job.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=job.cwd,
                    env=env,
                    **_spawn_options(),
                )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            return Outcome.failed(f"could not start: {exc}")
        exited = asyncio.ensure_future(proc.wait())
        try:
            self._records.add(key, proc.pid, _start_time(proc.pid))
            waits: set[asyncio.Future[Any]] = {exited, run.stop}
            await asyncio.wait(waits, timeout=launch.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finished, stopped = exited.done(), run.stop.done()
        finally:
            await _kill_group(proc.pid, exited)
            self._records.remove(key)
        if not finished:
            return self._cut_short(launch, stopped, self._tail(log_path))
        code = exited.result()
        error = None if code == 0 else _exit_text(code)
        return Outcome(code == 0, {"exit_code": code}, error, False, False, self._tail(log_path))

    async def _spawn(self) -> _Worker:
        return await _Worker.spawn(self._records, self._worker_out)

    async def _handler(self, run: _Run, launch: Launch, job: HandlerJob, log_path: Path) -> Outcome:
        try:
            worker = await self._take_worker(run)
        except _Stopped:
            return Outcome.halted()
        key = (launch.task_id, launch.attempt)
        message = {
            "handler": job.handler,
            "args": job.args,
            "env": {**launch.env, **_task_env(launch)},
        }
        if launch.inputs is not None:
            message["inputs"] = launch.inputs
        line = json.dumps(message).encode() + b"\n"
        answer, gone, stopped, tail = None, True, False, ""
        try:
            for last_try in (False, True):
                if worker is None or worker.exited.done():
                    try:
                        worker = await self._spawn()
                    except (OSError, RuntimeError) as exc:
                        return Outcome.failed(f"could not start a handler worker: {describe(exc)}")
                assert worker.record is not None
                self._records.link(key, worker.record)
                try:
                    answer, gone = await worker.call(line, run.stop, launch.timeout_s)
                except _Undelivered:
                    await worker.kill()
                    worker.discard()
                    if not last_try:
                        continue  # it never saw the job: a fresh worker may run it
                stopped = run.stop.done()
                break
            assert worker is not None
            if answer is None:
                await worker.kill()
            tail = await self._keep_output(worker, log_path)
        finally:
            self._records.remove(key)
            if answer is not None:
                self._idle.put_nowait(worker)
            else:
                self._refill(worker)
        if answer is not None:
            if answer["ok"]:
                return Outcome(True, answer.get("result"), None, False, False, tail)
            return Outcome.failed(str(answer.get("error")), tail)
        if stopped or not gone:
            return self._cut_short(launch, stopped, tail)
        error = f"handler worker died: {_exit_text(worker.proc.returncode)}"
        log.warning("attempt %s/%s: %s", *key, error, extra={"task_id": key[0], "attempt": key[1]})
        return Outcome.failed(error, tail)

    async def _keep_output(self, worker: _Worker, log_path: Path) -> str:
        """Copy what the job printed to the attempt's log; return its tail ("" if nothing)."""
        try:
            size = worker.out.stat().st_size
        except OSError:
            return ""
        if size == 0:
            return ""
        await asyncio.to_thread(shutil.copyfile, worker.out, log_path)
        return _tail(log_path, self.log_tail_bytes)

    async def _take_worker(self, run: _Run) -> _Worker | None:
        """A free slot's worker (None: the slot has none yet); raises _Stopped if stopped first."""
        if not self._idle.empty():
            return self._idle.get_nowait()
        getter = asyncio.ensure_future(self._idle.get())
        waits: set[asyncio.Future[Any]] = {getter, run.stop}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not run.stop.done():
            return getter.result()
        if getter.done():
            self._idle.put_nowait(getter.result())
        else:
            getter.cancel()
        raise _Stopped

    def _refill(self, worker: _Worker | None) -> None:
        """Replace a broken worker off the caller's path: its outcome need not wait for a start."""

        async def refill() -> None:
            fresh = None
            try:
                if worker is not None:
                    await worker.kill()
                    worker.discard()
                if not self._closed:
                    fresh = await self._spawn()
            except (OSError, RuntimeError):
                log.exception("could not start a handler worker; the next handler job will retry")
            finally:
                self._idle.put_nowait(fresh)

        task = asyncio.create_task(refill())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)
