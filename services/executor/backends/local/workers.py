"""A handler worker as the executor sees it: the `worker.py` process under its shim, its job and
reply pipes, and the jobs it has — run in the order given, the first running (or about to),
the rest waiting behind it (pool.py decides who waits where).

What a worker's handlers print goes to its own file, `out`, emptied at the start of each job
and moved to the attempt's log by the worker only when there is something: a new file per
job would cost more than the rest of a no-op handler's round trip. A worker that finds its
next job waiting runs it without sleeping, which is what waiting at a busy worker saves; no
job waits long behind one that turns out slow: a nudge takes back what the worker has not
started (worker.py), and it runs elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from uuid import uuid4

from pydantic_core import from_json

from services.executor.backends.local import worker as worker_main
from services.executor.backends.local.exits import exit_text
from services.executor.backends.local.files import remove
from services.executor.backends.local.process import Proc, Warden
from services.executor.backends.local.records import Records
from services.executor.backends.local.replies import Replies
from services.executor.backends.local.tickets import Ticket, Verdict, ran_for
from services.executor.backends.local.worker import READY

log = logging.getLogger(__name__)

STOP_GRACE_S = 1.0  # between SIGTERM and SIGKILL
WORKER_START_TIMEOUT_S = 60.0
# A worker holding waiting jobs that has answered nothing for this long is nudged to give them
# back (the pool queues behind a worker only while its first job is younger than that).
RESCUE_S = 0.02
# How long a nudged worker may take to answer before a stop or a timeout kills it anyway.
NUDGE_WAIT_S = 1.0


class Undelivered(Exception):
    """The worker was gone before it could take the job: safe to retry on a fresh one."""


class Worker:
    """One handler worker process, its job pipe and its reply pipe, and the jobs it has: run
    in the order given, the first running (or about to), the rest waiting behind it."""

    def __init__(self, proc: Proc, jobs: asyncio.StreamWriter, replies: Replies, out: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.jobs = jobs
        self.replies = replies
        self.out = out
        self.out_name = str(out)  # stat()ed after a killed job: no Path to render each time
        self.record: Path | None = None
        self.exited: asyncio.Future[Any] = proc.ended
        self.jobs_taken = 0  # jobs delivered to it (WorkerPool retires it after max_jobs)
        self.broke = False  # it wrote a line that is no reply to a job it has
        self.dead = False  # died, broke or was killed: it takes no more jobs
        self.retire: str | None = None  # what a job changed for good (jobstate.py)
        self.holders = 0  # callers with a ticket of it they have not released
        self.pending: dict[str, Ticket] = {}  # its jobs without a verdict, in the order given
        self.on_answer: Callable[[float], None] | None = None  # how long a job took, first
        self._outgoing: list[tuple[str, bytes]] = []  # jobs to write at this loop turn's end
        self._nudge: asyncio.Future[bool] | None = None  # a nudge not answered yet
        self._halts: dict[str, str] = {}  # jobs being halted, and why
        self.rescue_s = RESCUE_S  # the pool's
        self._rescue: asyncio.TimerHandle | None = None
        self._grace: asyncio.TimerHandle | None = None
        self._graced = self._killed = self._ended = False
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def spawn(
        cls,
        warden: Warden,
        records: Records,
        out_dir: Path,
        env: Mapping[str, str],
        freeze_max_s: float,
    ) -> Worker:
        name = uuid4().hex
        out = out_dir / f"{name}.out"
        job_r, job_w = os.pipe2(os.O_CLOEXEC)
        reply_r, reply_w = os.pipe2(os.O_CLOEXEC)
        try:
            proc = await warden.spawn(
                [sys.executable, "-P", str(Path(worker_main.__file__)), str(out)],
                env,
                pipes=(job_r, reply_w),
                freeze_max_s=freeze_max_s,
            )
        except BaseException:
            os.close(job_w)
            os.close(reply_r)
            raise
        loop = asyncio.get_running_loop()
        replies = Replies()
        await loop.connect_read_pipe(lambda: replies, os.fdopen(reply_r, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(job_w, "wb", 0)
        )
        jobs = asyncio.StreamWriter(transport, protocol, None, loop)
        worker = cls(proc, jobs, replies, out)
        try:
            await replies.wait(worker.exited, timeout=WORKER_START_TIMEOUT_S)
            if replies.take() != READY:
                await asyncio.wait({worker.exited}, timeout=STOP_GRACE_S)
                code = worker.exited.result().code if worker.exited.done() else None
                why = proc.error or exit_text(code)
                raise RuntimeError(f"handler worker did not start: {why}")
            worker.record = records.add_worker(name, proc.pid, proc.start_time)
        except BaseException:
            await worker.kill()
            raise
        replies.on_change = worker._advance
        worker.exited.add_done_callback(lambda _: worker._advance())
        return worker

    # -- giving jobs --------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Alive, whole, and not waiting for the answer to a nudge."""
        return not (self.dead or self.exited.done() or self.jobs.is_closing()) and not self._nudge

    def first_since(self) -> float | None:
        """When its first job became its first (loop time); None when it has none."""
        for ticket in self.pending.values():
            return ticket.head_at
        return None

    def submit(self, message: bytes, job: str, timeout: float | None) -> Ticket:
        """Give it a job (`message`, whose id is `job`), to run after those it has; raises
        Undelivered if it cannot take one."""
        if not self.usable:
            raise Undelivered
        ticket = Ticket(job, timeout)
        self.pending[job] = ticket
        self.jobs_taken += 1
        self.holders += 1
        if not self._outgoing:  # every job given this loop turn in one write
            asyncio.get_running_loop().call_soon(self._write)
        self._outgoing.append((job, message))
        if len(self.pending) == 1:
            self._promote()
        else:
            self._arm_rescue()
        return ticket

    def _write(self) -> None:
        outgoing, self._outgoing = self._outgoing, []
        if not outgoing:
            return
        if not self.dead and not self.jobs.is_closing():
            with contextlib.suppress(ConnectionError):
                self.jobs.write(b"".join(message for _, message in outgoing))
            if not self.jobs.is_closing():
                return
        # Not written, or a failed write (EPIPE: no reader), which closes the transport at
        # once having written nothing: those jobs were never taken, and may run elsewhere.
        self._take_back([stem for stem, _ in outgoing])
        self._end_soon()

    # -- replies ------------------------------------------------------------------------------

    def _advance(self) -> None:
        """Whatever changed — lines in, the pipe ended, the process exited, a grace ran out:
        apply what the worker said, then settle its end."""
        replies = self.replies
        while not self.broke and (line := replies.take()) is not None:
            self._on_line(line)
        if replies.broken:
            self._breach()
        if self.exited.done():
            if replies.ended or replies.broken or self.broke or self._graced:
                self._end()
            elif self._grace is None:  # what it wrote before it went may still be coming
                loop = asyncio.get_running_loop()
                self._grace = loop.call_later(STOP_GRACE_S, self._graced_out)
        elif replies.ended and self._grace is None:
            # Its reply pipe ended: it is exiting (the exit report follows), or it closed the
            # pipe and lives on — then no reply will come, and it is killed after the grace.
            self.dead = True
            loop = asyncio.get_running_loop()
            self._grace = loop.call_later(STOP_GRACE_S, self._end_soon)

    def _graced_out(self) -> None:
        self._graced = True
        self._advance()

    def _on_line(self, line: bytes) -> None:
        try:
            answer = from_json(line)  # pydantic's parser: a quarter of json.loads's cost
        except ValueError:
            answer = None
        if isinstance(answer, dict):
            # the answer to a nudge; one nobody asked for would have jobs run twice
            returned = answer.get("returned")
            if self._nudge is not None and isinstance(returned, list):
                self._take_back([s for s in returned if isinstance(s, str)])
                self._nudge.set_result(True)
                self._nudge = None
                return
            job = answer.get("job")
            ticket = self.pending.get(job) if isinstance(job, str) else None
            if ticket is not None and "ok" in answer:
                if answer.get("retire") is not None:  # it starts nothing more, and exits
                    self.retire = str(answer["retire"])[:200]
                self._settle(ticket, Verdict("answered", answer))
                if self.retire is not None and self.pending:
                    self._end_soon()  # what waits comes back at its end (killed, if it lingers)
                return
        # a line naming no job it has (written by what a handler left running, say) must not
        # become any job's outcome
        self._breach()

    def _settle(self, ticket: Ticket, verdict: Verdict) -> None:
        del self.pending[ticket.stem]
        if ticket.timer is not None:
            ticket.timer.cancel()
        if verdict.how == "answered" and self.on_answer is not None:
            self.on_answer(ran_for(verdict.answer, ticket))
        ticket.done.set_result(verdict)
        if not self._ended:
            self._promote()

    def _take_back(self, stems: list[str]) -> None:
        for stem in stems:
            ticket = self.pending.get(stem)
            if ticket is not None:
                self._settle(ticket, Verdict("returned"))

    def _promote(self) -> None:
        """Its first job's clocks start when it becomes the first: its run timeout, and the
        rescue of what waits behind it."""
        if self._rescue is not None:
            self._rescue.cancel()
            self._rescue = None
        for first in self.pending.values():
            if first.head_at is None:
                loop = asyncio.get_running_loop()
                first.head_at = loop.time()
                if first.timeout_s is not None:
                    first.timer = loop.call_later(first.timeout_s, self._timed_out, first)
            break
        self._arm_rescue()

    def _arm_rescue(self) -> None:
        since = self.first_since()
        if self._rescue is None and len(self.pending) > 1 and since is not None:
            loop = asyncio.get_running_loop()
            self._rescue = loop.call_at(since + self.rescue_s, self._rescue_now)

    def _rescue_now(self) -> None:
        """Jobs wait behind one that has run `rescue_s`: ask for them back (the callers run
        them elsewhere), and leave the slow one be."""
        self._rescue = None
        if len(self.pending) > 1 and self.usable:
            self._spawn_task(self.nudge())

    def _timed_out(self, ticket: Ticket) -> None:
        self._spawn_task(self.halt(ticket, "timed out"))

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- taking jobs back, halting ------------------------------------------------------------

    async def nudge(self) -> bool:
        """Ask it to give back the jobs it has not started (SIGUSR1 through its shim); True
        once it answered, within NUDGE_WAIT_S. It takes no job until it has."""
        if self.dead or self.exited.done():
            return False
        if self._nudge is None:
            self._nudge = asyncio.get_running_loop().create_future()
            if self._outgoing:  # what it was given must be in the pipe before it is asked
                self._write()
            self.proc.nudge()
        answered = self._nudge
        waits: set[asyncio.Future[Any]] = {answered, self.exited}
        await asyncio.wait(waits, timeout=NUDGE_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        return answered.done() and answered.result()

    async def halt(self, ticket: Ticket, why: str) -> None:
        """Stop a job (`why`: "stopped" or "timed out"). The first job a worker has is running
        (or about to): the worker is killed (its verdict: halted), and those behind it come
        back unstarted. One waiting behind another is asked back first (returned), so that
        the job running is not killed for it; only if it started meanwhile, or no answer
        comes, is the worker killed. Returns once the job has its verdict."""
        if ticket.done.done():
            return
        self._halts[ticket.stem] = why
        if next(iter(self.pending.values())) is not ticket:
            await self.nudge()
        if not ticket.done.done():
            await self.kill()
        await ticket.done

    def _breach(self) -> None:
        if not self.broke:
            self.broke = True
            self._end_soon()

    def _end_soon(self) -> None:
        """Take no more jobs, and kill it: its end settles the jobs it has."""
        self.dead = True
        self.jobs.close()
        if not self._killed:
            self._killed = True
            self.proc.kill()

    def _end(self) -> None:
        """It is gone: every job it still has gets its verdict."""
        if self._ended:
            return
        self._ended = True
        self.dead = True
        for timer in (self._rescue, self._grace):
            if timer is not None:
                timer.cancel()
        self._write()  # what it was never sent comes back, unstarted
        # A worker writes each reply before it takes its next job: when all it wrote was read
        # (to the pipe's end) and trusted, its first job without one is the one it was running
        # (or about to; none, after a reply that retired it), and those after it never started.
        # After a breach, or without the pipe's end, any of them may have started: none comes back.
        exact = self.replies.ended and not (self.broke or self.replies.broken)
        after = 0 if self.retire is not None else 1  # it exits right after retiring (worker.py)
        for i, ticket in enumerate(list(self.pending.values())):
            why = self._halts.get(ticket.stem)
            if i >= after and exact:
                self._settle(ticket, Verdict("returned"))
            else:
                how = "halted" if why else "lost"
                self._settle(ticket, Verdict(how, why=why or "", first=i == 0))
        if self._nudge is not None:
            self._nudge.set_result(False)
            self._nudge = None

    async def kill(self) -> None:
        self._end_soon()
        await asyncio.wait({self.exited})

    async def shutdown(self) -> None:
        self.dead = True
        self.jobs.close()  # no more jobs: the worker exits by itself
        await asyncio.wait({self.exited}, timeout=STOP_GRACE_S)
        await self.kill()
        self.discard()

    def discard(self) -> None:
        """Remove its files; only once it is dead and its last output copied."""
        remove(self.out)  # a job may have made it a directory
        if self.record is not None:
            remove(self.record)
