"""The local backend: runs each attempt as a local process tree under a shim of the node's
warden — a command's own process group, or a job in a pool of long-lived handler workers —
with a lease the shim enforces without the executor, and records each attempt under
state_dir/running so that the next executor on this state_dir kills what a crashed one left.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Set
from dataclasses import replace
from pathlib import Path
from typing import Any
from uuid import UUID

from pydantic_core import to_json

from services.executor.backends import Key, Launch, OneNode, Outcome
from services.executor.backends.local.env import task_base_env, task_env
from services.executor.backends.local.exits import exit_text
from services.executor.backends.local.files import move_or_tail, remove
from services.executor.backends.local.logcap import bound, keep_bounded
from services.executor.backends.local.outputs import prune_logs, tail, with_output
from services.executor.backends.local.pool import Stopped, WorkerPool
from services.executor.backends.local.process import Proc, SpawnError, Warden
from services.executor.backends.local.records import Records
from services.executor.backends.local.statedir import make_private, take_lock, write_inputs
from services.executor.backends.local.tickets import Ticket, Verdict
from services.executor.backends.local.worker import describe
from services.executor.backends.local.workers import STOP_GRACE_S, Undelivered, Worker
from shared.models import CommandJob, HandlerJob
from shared.runtime import first_done

log = logging.getLogger(__name__)


class _Run:
    """An attempt in flight here: the task running it, its process, and the future that asks
    it to stop."""

    def __init__(self) -> None:
        self.stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[Outcome]
        self.proc: Proc | None = None  # the command's tree, or the worker running the job
        # Where the attempt's lease ends (time.monotonic()), as its claim or last renewal
        # left it: kept as an end, not a length, so that a job which waits before its process
        # is there (a worker being started) is not given the length again from then on.
        self.lease_until: float | None = None

    def request_stop(self) -> None:
        if not self.stop.done():
            self.stop.set_result(None)

    def renew(self, seconds: float) -> None:
        self.lease_until = time.monotonic() + seconds

    def lease_s(self) -> float | None:
        """What is left of the lease, from now."""
        return None if self.lease_until is None else self.lease_until - time.monotonic()


class LocalBackend(OneNode):
    """Runs attempts on this machine: commands as process trees, handlers in up to `slots`
    long-lived workers (`warm_workers` started at once, the rest on first use)."""

    def __init__(
        self,
        slots: int,
        state_dir: Path,
        log_tail_bytes: int = 8192,
        warm_workers: int = 2,
        env_pass: Iterable[str] = (),
        freeze_max_s: float = 600.0,
        worker_max_jobs: int = 0,
        worker_depth: int = 8,
        log_max_bytes: int = 64 * 2**20,
    ) -> None:
        self.slots = slots
        # Handler workers started with the executor; the other slots start theirs on their
        # first handler job and keep it. A command-only node with 50 slots does not pay for 50
        # Python processes (seconds of CPU at start), and a handler node pays once per slot.
        self.warm_workers = min(warm_workers, slots)
        self.state_dir = state_dir.absolute()
        self.log_tail_bytes = log_tail_bytes
        self.log_max_bytes = log_max_bytes
        self.freeze_max_s = freeze_max_s
        self.base_env = task_base_env(env_pass)
        self.reaped: list[Key] = []  # attempts a previous executor left running, reaped at start
        self._logs = self.state_dir / "logs"
        self._logs_name = str(self._logs)
        self._worker_out = self.state_dir / "workers"
        self._io = self.state_dir / "io"  # per-attempt inputs and declared-output files
        self._records = Records(self.state_dir / "running")
        self._runs: dict[Key, _Run] = {}
        self._warden = Warden()
        where = (self._warden, self._records, self._worker_out, self.base_env)
        self._pool = WorkerPool(slots, *where, freeze_max_s, worker_max_jobs, worker_depth)
        self._lock: int | None = None
        self._started = False
        self._closed = False

    async def start(self) -> None:
        """Reap what a previous executor left running, then start the warden and the warm
        handler workers."""
        make_private(self.state_dir, (self._logs, self._worker_out, self._io, self._records.root))
        self._lock = take_lock(self.state_dir)
        self.reaped = self._records.reap()
        for stale in [*self._worker_out.iterdir(), *self._io.iterdir()]:
            remove(stale)  # whatever an attempt left there: a task may make it a directory
        await self._warden.start()
        self._started = True
        await self._pool.warm(self.warm_workers)

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
            if launch.lease_s is not None:
                run.lease_until = time.monotonic() + launch.lease_s
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

    def renew(self, key: Key, seconds: float) -> None:
        """Postgres renewed the attempt's lease: it lasts `seconds` from now (thaws it, unless
        its process holds a job whose lease is over: `_lease`)."""
        run = self._runs.get(key)
        if run is not None:
            run.renew(seconds)
            if run.proc is not None:
                self._lease(run.proc)

    def _lease(self, proc: Proc) -> None:
        """Tell `proc`'s shim when its lease ends: the earliest of the jobs it holds. A handler
        worker runs one job with others waiting behind it, and the job it runs may be one whose
        lease is over (its executor froze, a successor runs elsewhere now): a later lease of a
        job behind it must not thaw it, nor keep it from freezing. Jobs claimed together end
        together, so under load this is the lease they share (lease_job: one write)."""
        ends = [r.lease_until for r in self._runs.values() if r.proc is proc]
        until = min((e for e in ends if e is not None), default=None)
        if until is not None:
            proc.lease_job(until)

    def frozen(self, key: Key) -> bool:
        run = self._runs.get(key)
        return run is not None and run.proc is not None and run.proc.frozen

    async def watch(self) -> None:
        async with asyncio.TaskGroup() as group:  # either failing stops both
            group.create_task(self._warden.watch())
            group.create_task(keep_bounded(self._written, self.log_max_bytes))

    def _written(self) -> list[str]:
        """The files running attempts write: commands' logs, handler workers' out files."""
        runs = (self._log_name(f"{t}-{a}") for t, a in self._runs)
        return [*map(str, self._worker_out.iterdir()), *runs]

    async def close(self) -> None:
        """Stop every attempt still running, then the workers and the warden."""
        self._closed = True
        runs = list(self._runs.values())
        for run in runs:
            run.request_stop()
        if runs:
            await asyncio.wait({run.task for run in runs})
        await self._pool.close()
        await self._warden.close()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    async def _attempt(self, run: _Run, launch: Launch) -> Outcome:
        key = (launch.task_id, launch.attempt)
        stem = f"{key[0]}-{key[1]}"
        job = launch.job
        # Paths only for the files this attempt has: a no-op handler's round trip is short
        # enough that building five Path objects was a tenth of the executor's part of it.
        inputs_path = None if launch.inputs is None else self._io / f"{stem}.inputs.json"
        output_path = self._io / f"{stem}.output.json" if isinstance(job, CommandJob) else None
        try:
            io_env = {}
            if inputs_path is not None:
                await write_inputs(inputs_path, launch.inputs)  # 0600, never through a FIFO
                io_env["SKED_INPUTS"] = str(inputs_path)
            if output_path is not None:
                remove(output_path)
                io_env["SKED_OUTPUT"] = str(output_path)
            if io_env:
                launch = replace(launch, env={**launch.env, **io_env})
            if isinstance(job, CommandJob):
                assert output_path is not None
                outcome = await self._command(run, launch, job, self._log_path(stem))
                return with_output(outcome, output_path)
            return await self._handler(run, launch, job, stem)
        except Exception as exc:
            log.exception(
                "attempt %s/%s: backend failure", *key, extra={"task_id": key[0], "attempt": key[1]}
            )
            last = tail(self._log_path(stem), self.log_tail_bytes)
            return Outcome.failed(f"executor error: {describe(exc)}", last)
        finally:
            del self._runs[key]
            if inputs_path is not None:
                remove(inputs_path)
            if output_path is not None:  # a handler's attempt never has one
                remove(output_path)

    def _log_name(self, stem: str) -> str:
        # a string: a handler job builds one, and a Path and its str cost ~8 µs a job
        return f"{self._logs_name}/{stem}.log"

    def _log_path(self, stem: str) -> Path:
        return Path(self._log_name(stem))

    async def log_tail(self, key: Key, limit: int) -> str | None:
        path = self._log_path(f"{key[0]}-{key[1]}")
        return tail(path, limit) if path.exists() else None

    async def prune(self, older_than_s: float, keep: Set[Key]) -> int:
        return await asyncio.to_thread(prune_logs, self._logs, older_than_s, keep)

    async def _end_log(self, log_name: str) -> str:
        """An ended attempt's log bounded now its writers are gone (the head a live cut freed
        becomes the note of what went), and its tail."""
        await bound(log_name, self.log_max_bytes, compact=True)
        return tail(log_name, self.log_tail_bytes)

    def _cut_short(self, launch: Launch, stopped: bool, log_tail: str) -> Outcome:
        """The outcome of an attempt that was stopped or ran out of time."""
        if stopped:
            return Outcome.halted(log_tail)
        error = f"timed out after {float(launch.timeout_s or 0)} s"
        return Outcome.failed(error, log_tail, timed_out=True)

    async def _command(self, run: _Run, launch: Launch, job: CommandJob, log_path: Path) -> Outcome:
        key = (launch.task_id, launch.attempt)
        env = {**self.base_env, **job.env, **launch.env, **task_env(launch)}
        try:
            proc = await self._warden.spawn(
                job.argv,
                env,
                cwd=job.cwd,
                log_path=log_path,
                lease_s=run.lease_s(),
                freeze_max_s=self.freeze_max_s,
            )
        except SpawnError as exc:  # the node's failure, not the task's (Proc.error is that)
            return Outcome.launch_failed(f"could not start: {exc}")
        run.proc = proc
        try:
            self._records.add(key, proc.pid, proc.start_time)
            waits: set[asyncio.Future[Any]] = {proc.ended, run.stop}
            await asyncio.wait(waits, timeout=launch.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finished, stopped = proc.ended.done(), run.stop.done()
            if not finished:
                proc.stop(STOP_GRACE_S)
            ended = await proc.wait()
        finally:
            self._records.remove(key)
        if proc.error is not None:
            return Outcome.failed(f"could not start: {proc.error}")
        tail = await self._end_log(str(log_path))
        if not finished:
            return self._cut_short(launch, stopped, tail)
        if ended.how == "frozen too long":
            return Outcome.failed(self._lapsed(), tail)
        code = ended.code
        error = None if code == 0 else exit_text(code)
        return Outcome(code == 0, {"exit_code": code}, error, False, False, tail)

    def _lapsed(self) -> str:
        return (
            f"lease lapsed: frozen for {self.freeze_max_s:g} s without a renewal "
            "(its node was cut off or frozen), then killed"
        )

    async def _handler(self, run: _Run, launch: Launch, job: HandlerJob, stem: str) -> Outcome:
        key = (launch.task_id, launch.attempt)
        log_name = self._log_name(stem)
        message = {
            "job": stem,  # the attempt's name: its reply must carry it
            "handler": job.handler,
            "args": job.args,
            "env": {**launch.env, **task_env(launch)},
            "log": log_name,  # where the worker moves what the job printed
        }
        if launch.inputs is not None:
            message["inputs"] = launch.inputs
        line = to_json(message) + b"\n"  # pydantic's encoder: a fifth of json.dumps's cost
        may_queue, fresh_tries = True, 2
        while True:
            try:
                worker = await self._pool.take(run.stop, queue=may_queue)
            except Stopped:
                return Outcome.halted()
            if worker is None or (worker.holders == 0 and not worker.usable):
                # a slot with no worker yet, or with one that died idle: start one for it
                fresh_tries -= 1
                if worker is not None:
                    await worker.kill()
                    worker.discard()
                try:
                    worker = await self._pool.spawn()
                except (OSError, RuntimeError, SpawnError) as exc:
                    self._pool.give_back(None)
                    return Outcome.failed(f"could not start a handler worker: {describe(exc)}")
            try:
                ticket = self._pool.submit(worker, line, stem, launch.timeout_s)
            except Undelivered:
                # a busy worker that just went: try a free slot; a fresh one that did: its slot
                if worker.holders == 0:
                    self._pool.give_back(worker)
                may_queue = False
                if fresh_tries <= 0:
                    return Outcome.failed("could not start a handler worker: it died at once")
                continue
            try:
                run.proc = worker.proc
                self._lease(worker.proc)
                verdict = await self._verdict(worker, ticket, run.stop)
                run.proc = None
                if verdict.how == "returned":  # never started: on another worker, unless stopped
                    if run.stop.done():
                        return Outcome.halted()
                    may_queue = False
                    continue
                if verdict.how == "answered":
                    answer = verdict.answer or {}
                    tail = await self._end_log(log_name) if answer.get("log") is True else ""
                    if answer.get("ok") is True:
                        return Outcome(True, answer.get("result"), None, False, False, tail)
                    return Outcome.failed(str(answer.get("error")), tail)
                tail = await self._keep_output(worker, Path(log_name)) if verdict.first else ""
            finally:
                self._pool.release(worker)
            if verdict.how == "halted":
                return self._cut_short(launch, verdict.why == "stopped", tail)
            ended = worker.exited.result() if worker.exited.done() else None
            if ended is not None and ended.how == "frozen too long":
                return Outcome.failed(self._lapsed(), tail)
            error = f"handler worker died: {exit_text(ended.code if ended else None)}"
            if worker.broke:
                error = "handler worker wrote a line that is not this job's reply; it was killed"
            log.warning(
                "attempt %s/%s: %s", *key, error, extra={"task_id": key[0], "attempt": key[1]}
            )
            return Outcome.failed(error, tail)

    @staticmethod
    async def _verdict(worker: Worker, ticket: Ticket, stop: asyncio.Future[None]) -> Verdict:
        """The ticket's verdict; a stop asked meanwhile halts the job (or takes it back)."""
        if not ticket.done.done():
            await first_done(ticket.done, stop)
            if not ticket.done.done():
                await worker.halt(ticket, "stopped")
        return ticket.done.result()

    async def _keep_output(self, worker: Worker, log_path: Path) -> str:
        """What a job cut short printed (its worker's out file) to the attempt's log; its
        tail ("" if nothing). A job that ended moved its output there itself."""
        try:
            if os.stat(worker.out_name).st_size == 0:
                return ""
        except OSError:
            return ""
        try:  # its worker is dead: the file is the log's now (moved; a bounded tail if not)
            await asyncio.to_thread(move_or_tail, worker.out_name, log_path)
        except OSError as exc:
            log.warning("output of a job cut short not kept in %s: %s", log_path, exc)
        return await self._end_log(str(log_path))
