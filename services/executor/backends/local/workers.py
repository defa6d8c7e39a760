"""Handler workers: long-lived `worker.py` processes, one per slot, each under a shim of its own.

Handlers get a pool of our own because concurrent.futures' process pool cannot kill the one
job that timed out or was stopped: here that worker's tree is killed and a fresh one started.
What a worker's handlers print goes to its own file, `out`, emptied at the start of each job,
and is copied to the attempt's log only when there is something: a new file per job would
cost more than the rest of a no-op handler's round trip.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from uuid import uuid4

from services.executor.backends.local import worker as worker_main
from services.executor.backends.local.process import Proc, SpawnError, Warden, exit_text
from services.executor.backends.local.records import Records
from services.executor.backends.local.worker import MAX_REPLY_BYTES, READY

log = logging.getLogger(__name__)

STOP_GRACE_S = 1.0  # between SIGTERM and SIGKILL
WORKER_START_TIMEOUT_S = 60.0


class Undelivered(Exception):
    """The worker was gone before it could take the job: safe to retry on a fresh one."""


class Replies(asyncio.Protocol):
    """A worker's reply pipe: its lines, each taken by the call waiting for it.

    Not an asyncio.StreamReader: its readline wants a task of its own per job, and
    asyncio.wait around that task, the worker's death and a stop — together about a tenth
    of the executor's side of a no-op handler's round trip (docs/performance.md)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._lines: deque[bytes] = deque()
        self.ended = False  # end of file: the worker died, or closed its end
        self.broken = False  # a line longer than MAX_REPLY_BYTES: no reply can be trusted
        self._waiter: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        end = data.find(b"\n")
        buffer += data
        if end >= 0:
            end += len(buffer) - len(data)
            while end >= 0:
                self._lines.append(bytes(buffer[: end + 1]))
                del buffer[: end + 1]
                end = buffer.find(b"\n")
            self._wake()
        if len(buffer) > MAX_REPLY_BYTES + 1024:
            self.broken = True
            buffer.clear()
            self._wake()

    def eof_received(self) -> None:
        self.ended = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._wake()

    def _wake(self, _: object = None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def answered(self) -> bool:
        """A line is in, or none will come."""
        return bool(self._lines) or self.ended or self.broken

    def take(self) -> bytes | None:
        """The next whole line; None if there is none (and, with `answered()`, none will be)."""
        if self.broken or not self._lines:
            return None
        return self._lines.popleft()

    def forget(self) -> None:
        """Drop lines nobody asked for (a worker writes one reply a job: there are none)."""
        self._lines.clear()

    async def wait(self, *also: asyncio.Future[Any], timeout: float | None) -> None:
        """Until `answered()`, one of `also` is done, or `timeout` seconds pass."""
        if self.answered() or any(f.done() for f in also):
            return
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        for future in also:
            future.add_done_callback(self._wake)
        timer = None if timeout is None else loop.call_later(timeout, self._wake)
        try:
            await self._waiter
        finally:
            self._waiter = None
            for future in also:
                future.remove_done_callback(self._wake)
            if timer is not None:
                timer.cancel()


class Worker:
    """One handler worker process, its job pipe and its reply pipe."""

    def __init__(self, proc: Proc, jobs: asyncio.StreamWriter, replies: Replies, out: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.jobs = jobs
        self.replies = replies
        self.out = out
        self.out_name = str(out)  # stat()ed after every job: no Path to render each time
        self.record: Path | None = None
        self.exited: asyncio.Future[Any] = proc.ended
        self.jobs_taken = 0  # jobs delivered to it (WorkerPool retires it after max_jobs)
        self.broke = False  # it wrote a line that was not the reply to the job at hand

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
                raise RuntimeError(f"handler worker did not start: {exit_text(code)}")
            worker.record = records.add_worker(name, proc.pid, proc.start_time)
        except BaseException:
            await worker.kill()
            raise
        return worker

    async def call(
        self, message: bytes, job: str, stop: asyncio.Future[None], timeout: float | None
    ) -> tuple[dict[str, Any] | None, bool]:
        """Send a job (`message`, whose id is `job`) and wait for its reply, the worker's death,
        a stop or the timeout.

        Returns the reply (None if there is none), and whether the worker is gone (died, or broke
        the protocol: a reply that names another job is one). Raises Undelivered if the worker
        was gone before it took the job.
        """
        if self.exited.done():
            raise Undelivered
        replies = self.replies
        replies.forget()
        try:
            self.jobs.write(message)
            # A failed write (EPIPE) only closes the transport; drain() may not raise in time.
            if self.jobs.is_closing():
                raise Undelivered
            await self.jobs.drain()
        except ConnectionError:
            raise Undelivered from None
        self.jobs_taken += 1
        await replies.wait(self.exited, stop, timeout=timeout)
        if self.exited.done() and not replies.answered():
            await replies.wait(timeout=STOP_GRACE_S)  # what it wrote before it went
        if not replies.answered():
            return None, self.exited.done()
        line = replies.take()
        answer = _parse_reply(line, job)
        if answer is None and line is not None:
            self.broke = True
        return answer, answer is None

    async def kill(self) -> None:
        self.jobs.close()
        self.proc.kill()
        await asyncio.wait({self.exited})

    async def shutdown(self) -> None:
        self.jobs.close()  # no more jobs: the worker exits by itself
        await asyncio.wait({self.exited}, timeout=STOP_GRACE_S)
        await self.kill()
        self.discard()

    def discard(self) -> None:
        """Remove its files; only once it is dead and its last output copied."""
        self.out.unlink(missing_ok=True)
        if self.record is not None:
            self.record.unlink(missing_ok=True)


def _parse_reply(line: bytes | None, job: str) -> dict[str, Any] | None:
    """The reply to job `job`; None for anything else: a line naming another job (written by
    what a handler left running, say) must not become this job's outcome."""
    if line is None:
        return None  # end of file (the worker died mid-job), or a line past the limit
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    if not isinstance(answer, dict) or "ok" not in answer or answer.get("job") != job:
        return None
    return answer


class Stopped(Exception):
    """Stopped while waiting for a free handler worker."""


class WorkerPool:
    """One item per slot: its live worker, or None until one is started for it.

    A worker that has taken `max_jobs` jobs (0: no bound) is retired, and a fresh one started
    for its slot off the caller's path. Every job's SKED_TASK_ID and SKED_HEARTBEAT_TOKEN are
    new values, and glibc's setenv keeps every value it was ever given (~220 bytes a job:
    ~220 MB a million jobs, per worker); a handler's own leaks are bounded the same way."""

    def __init__(
        self,
        slots: int,
        warden: Warden,
        records: Records,
        out_dir: Path,
        env: Mapping[str, str],
        freeze_max_s: float,
        max_jobs: int = 0,
    ) -> None:
        self._max_jobs = max_jobs
        self._warden = warden
        self._records = records
        self._out_dir = out_dir
        self._env = env
        self._freeze_max_s = freeze_max_s
        # Last in, first out: the worker that answered last takes the next job. Its memory is
        # still in the CPU's caches; handing jobs round all the slots' workers in turn made
        # a no-op job cost its worker 93 µs of CPU, not 50, one job at a time (16 slots).
        self._idle: asyncio.Queue[Worker | None] = asyncio.LifoQueue()
        for _ in range(slots):
            self._idle.put_nowait(None)
        self._refills: set[asyncio.Task[None]] = set()
        self.closed = False

    async def spawn(self) -> Worker:
        return await Worker.spawn(
            self._warden, self._records, self._out_dir, self._env, self._freeze_max_s
        )

    async def warm(self, n: int) -> None:
        """Start `n` workers now (the other slots start theirs on their first handler job)."""
        empty = [self._idle.get_nowait() for _ in range(min(n, self._idle.qsize()))]
        spawned = await asyncio.gather(*(self.spawn() for _ in empty), return_exceptions=True)
        for worker in spawned:
            self._idle.put_nowait(worker if isinstance(worker, Worker) else None)
        for worker in spawned:
            if isinstance(worker, BaseException):
                raise worker

    async def take(self, stop: asyncio.Future[None]) -> Worker | None:
        """A free slot's worker (None: the slot has none yet); raises Stopped if stopped first."""
        if not self._idle.empty():
            return self._idle.get_nowait()
        getter = asyncio.ensure_future(self._idle.get())
        waits: set[asyncio.Future[Any]] = {getter, stop}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not stop.done():
            return getter.result()
        if getter.done():
            self._idle.put_nowait(getter.result())
        else:
            getter.cancel()
        raise Stopped

    def give_back(self, worker: Worker | None) -> None:
        """A slot's worker after a job it answered: kept, or retired at max_jobs."""
        if worker is not None and 0 < self._max_jobs <= worker.jobs_taken:
            log.info("handler worker %d retired after %d jobs", worker.pid, worker.jobs_taken)
            self.refill(worker)
            return
        self._idle.put_nowait(worker)

    def refill(self, worker: Worker | None) -> None:
        """Replace a broken worker off the caller's path: its outcome need not wait for a start."""

        async def refill() -> None:
            fresh = None
            try:
                if worker is not None:
                    await worker.kill()
                    worker.discard()
                if not self.closed:
                    fresh = await self.spawn()
            except (OSError, RuntimeError, SpawnError):
                log.exception("could not start a handler worker; the next handler job will retry")
            finally:
                self._idle.put_nowait(fresh)

        task = asyncio.create_task(refill())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def close(self) -> None:
        self.closed = True
        # Not cancelled: a refill in the middle of a kill must finish it. Each is bounded.
        await asyncio.gather(*self._refills)
        workers = [self._idle.get_nowait() for _ in range(self._idle.qsize())]
        await asyncio.gather(*(w.shutdown() for w in workers if w is not None))
