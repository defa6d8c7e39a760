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


class Worker:
    """One handler worker process, its job pipe and its reply pipe."""

    def __init__(
        self, proc: Proc, jobs: asyncio.StreamWriter, replies: asyncio.StreamReader, out: Path
    ) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.jobs = jobs
        self.replies = replies
        self.out = out
        self.out_name = str(out)  # stat()ed after every job: no Path to render each time
        self.record: Path | None = None
        self.exited: asyncio.Future[Any] = proc.ended

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
        replies = asyncio.StreamReader(limit=MAX_REPLY_BYTES + 1024)
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(replies), os.fdopen(reply_r, "rb", 0)
        )
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(job_w, "wb", 0)
        )
        jobs = asyncio.StreamWriter(transport, protocol, None, loop)
        worker = cls(proc, jobs, replies, out)
        try:
            async with asyncio.timeout(WORKER_START_TIMEOUT_S):
                line = await replies.readline()
            if line != READY:
                await asyncio.wait({worker.exited}, timeout=STOP_GRACE_S)
                code = worker.exited.result().code if worker.exited.done() else None
                raise RuntimeError(f"handler worker did not start: {exit_text(code)}")
            worker.record = records.add_worker(name, proc.pid, proc.start_time)
        except BaseException:
            await worker.kill()
            raise
        return worker

    async def call(
        self, message: bytes, stop: asyncio.Future[None], timeout: float | None
    ) -> tuple[dict[str, Any] | None, bool]:
        """Send a job and wait for its reply, the worker's death, a stop or the timeout.

        Returns the reply (None if there is none), and whether the worker is gone (died, or broke
        the protocol). Raises Undelivered if the worker was gone before it took the job.
        """
        if self.exited.done():
            raise Undelivered
        try:
            self.jobs.write(message)
            # A failed write (EPIPE) only closes the transport; drain() may not raise in time.
            if self.jobs.is_closing():
                raise Undelivered
            await self.jobs.drain()
        except ConnectionError:
            raise Undelivered from None
        reply = asyncio.ensure_future(self.replies.readline())
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


def _parse_reply(reply: asyncio.Future[bytes]) -> dict[str, Any] | None:
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


class Stopped(Exception):
    """Stopped while waiting for a free handler worker."""


class WorkerPool:
    """One item per slot: its live worker, or None until one is started for it."""

    def __init__(
        self,
        slots: int,
        warden: Warden,
        records: Records,
        out_dir: Path,
        env: Mapping[str, str],
        freeze_max_s: float,
    ) -> None:
        self._warden = warden
        self._records = records
        self._out_dir = out_dir
        self._env = env
        self._freeze_max_s = freeze_max_s
        self._idle: asyncio.Queue[Worker | None] = asyncio.Queue()
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
