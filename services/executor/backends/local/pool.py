"""Handler workers: long-lived `worker.py` processes, one per slot, each under a shim of its own.

Handlers get a pool of our own because concurrent.futures' process pool cannot kill the one
job that timed out or was stopped: here that worker's tree is killed and a fresh one started.

While a node's handler jobs run short, a job may be given to a worker that is busy: it waits
there, behind the few already given, instead of waking an idle worker. Waking a process is
most of what a short job costs on a small machine (docs/performance.md, "The twelfth
session").
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.executor.backends.local.process import SpawnError, Warden
from services.executor.backends.local.records import Records
from services.executor.backends.local.tickets import Ticket
from services.executor.backends.local.workers import RESCUE_S, Worker

log = logging.getLogger(__name__)

# A job waits behind another only while the node's recent jobs ran this short on average (the
# last RECENT_JOBS, at least MIN_RECENT of them, as their workers said).
QUEUE_BELOW_S = 0.002
RECENT_JOBS, MIN_RECENT = 32, 8


class Stopped(Exception):
    """Stopped while waiting for a free handler worker."""


class WorkerPool:
    """One item per slot: its live worker, or None until one is started for it.

    A job goes to a free slot's worker, the one that answered last first; or, while the
    node's jobs run short, behind the jobs of a busy worker (at most `depth` in all) whose
    current job began just now — the one with the most, so that a burst keeps few workers
    awake. A worker that has taken `max_jobs` jobs (0: no bound) is retired, and a fresh one
    started for its slot off the caller's path. Every job's SKED_TASK_ID and
    SKED_HEARTBEAT_TOKEN are new values, and glibc's setenv keeps every value it was ever
    given (~220 bytes a job: ~220 MB a million jobs, per worker); a handler's own leaks are
    bounded the same way."""

    def __init__(
        self,
        slots: int,
        warden: Warden,
        records: Records,
        out_dir: Path,
        env: Mapping[str, str],
        freeze_max_s: float,
        max_jobs: int = 0,
        depth: int = 8,
        rescue_s: float = RESCUE_S,
    ) -> None:
        self._max_jobs = max_jobs
        self.depth = depth
        self.rescue_s = rescue_s
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
        self._busy: dict[Worker, None] = {}  # workers with holders, in the order they got one
        self._recent: deque[float] = deque(maxlen=RECENT_JOBS)  # how long jobs took, first
        self._refills: set[asyncio.Task[None]] = set()
        self.closed = False

    async def spawn(self) -> Worker:
        worker = await Worker.spawn(
            self._warden, self._records, self._out_dir, self._env, self._freeze_max_s
        )
        worker.on_answer = self._recent.append
        worker.rescue_s = self.rescue_s
        return worker

    async def warm(self, n: int) -> None:
        """Start `n` workers now (the other slots start theirs on their first handler job)."""
        empty = [self._idle.get_nowait() for _ in range(min(n, self._idle.qsize()))]
        spawned = await asyncio.gather(*(self.spawn() for _ in empty), return_exceptions=True)
        for worker in spawned:
            self._idle.put_nowait(worker if isinstance(worker, Worker) else None)
        for worker in spawned:
            if isinstance(worker, BaseException):
                raise worker

    def short(self) -> bool:
        """The node's last jobs ran short: a job may wait behind another."""
        recent = self._recent
        return len(recent) >= MIN_RECENT and sum(recent) < QUEUE_BELOW_S * len(recent)

    def busy_worker(self) -> Worker | None:
        """A busy worker a job may wait at, or None (see the class doc)."""
        if self.depth <= 1 or not self._busy or not self.short():
            return None
        fresh = asyncio.get_running_loop().time() - self.rescue_s
        best, most = None, 0
        for worker in self._busy:
            n = len(worker.pending)
            fit = worker.usable and worker.retire is None and not self._spent(worker)
            if most < n < self.depth and fit:
                since = worker.first_since()
                if since is not None and since > fresh:
                    best, most = worker, n
        return best

    async def take(self, stop: asyncio.Future[None], *, queue: bool = True) -> Worker | None:
        """A worker for a job: a busy one it may wait at (`queue`), else a free slot's (None:
        the slot has none yet); raises Stopped if stopped first."""
        if queue:
            busy = self.busy_worker()
            if busy is not None:
                return busy
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

    def submit(self, worker: Worker, message: bytes, job: str, timeout: float | None) -> Ticket:
        """Give `worker` (from take(), or spawned for a slot take() gave) a job; release() it
        once the ticket has its verdict."""
        ticket = worker.submit(message, job, timeout)
        self._busy[worker] = None
        return ticket

    def release(self, worker: Worker) -> None:
        """A caller is done with the ticket it had of `worker`: the last one frees it — kept
        for its slot, retired at max_jobs, or replaced when it is dead."""
        worker.holders -= 1
        if worker.holders > 0:
            return
        self._busy.pop(worker, None)
        if worker.retire is not None:  # (it exits by itself: worker.py)
            log.warning("handler worker %d retired: a job changed %s", worker.pid, worker.retire)
            self.refill(worker)
        elif worker.dead or worker.exited.done():
            self.refill(worker)
        elif self._spent(worker):
            log.info("handler worker %d retired after %d jobs", worker.pid, worker.jobs_taken)
            self.refill(worker)
        else:
            worker.proc.unlease_soon()
            self._idle.put_nowait(worker)

    def _spent(self, worker: Worker) -> bool:
        return 0 < self._max_jobs <= worker.jobs_taken

    def give_back(self, worker: Worker | None) -> None:
        """A slot take() gave, unused (None: it still has no worker)."""
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
