"""The executor's side of the warden: start it, spawn processes through it, and steer each
one's shim — renew its lease, stop it, kill it — over a pipe, reading its reports on another.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from services.executor.backends.local.env import without_secrets
from services.executor.backends.local.exits import Exit, exit_text
from services.executor.warden import proctree, wire
from services.executor.warden.shim import KILL_ROUNDS_S

log = logging.getLogger(__name__)

WARDEN_START_TIMEOUT_S = 30.0
# A spawn request that no shim has answered (with the forked leader's pid) in this long went
# to a stopped shim or warden — any process of the executor's user can SIGSTOP one: the
# attempt goes back as not started rather than hold its slot for ever, and what is found
# stopped is continued (Warden.continue_stopped).
SPAWN_ANSWER_S = 20.0


class SpawnError(Exception):
    """The process could not be started: no shim answered (`Proc.error` tells why a program
    that was forked did not start: the program is missing, the directory, ...)."""


# An idle worker's lease is dropped this long before it would run out (Proc.unlease_soon).
UNLEASE_AHEAD_S = 0.5
# A job's lease may leave the shim's deadline from the worker's previous job standing when
# that ends at most this much sooner (a tenth of the lease, at most a second): Proc.lease_job.
JOB_SLACK, JOB_SLACK_S = 0.1, 1.0
# After its exit line a shim closes the report pipe at once; one wedged before it is waited
# for no longer than this (Proc._line).
EXIT_EOF_S = 1.0
# A shim told to stop or kill its tree reports the end within the grace and its kill rounds;
# one silent this much longer was stopped by its own task (SIGSTOP to the leader's parent),
# and the executor kills the tree's group and the shim itself (Proc._force).
SHIM_ANSWER_S = KILL_ROUNDS_S + 2.0
LAPSE_ANSWER_S = 0.5  # a shim silent this long past the lease's end is looked at: _lapsed


class Proc:
    """One process tree under its shim."""

    def __init__(self, ctl: int, report: int, vanished: Callable[[], None] = lambda: None) -> None:
        loop = asyncio.get_running_loop()
        self._ctl = ctl
        self._report = report
        self._vanished = vanished  # its shim died without a word: whoever cleans up, wake it
        self._buffer = b""
        self.pid = 0
        self.start_time = 0
        self.shim_pid = 0
        self._force_at: asyncio.TimerHandle | None = None  # after a stop or kill (_force)
        self.error: str | None = None  # why the program did not start (its exec failed)
        self.frozen = False
        self._expiry: float | None = None  # the lease's end as the shim was told (monotonic)
        self._unlease: asyncio.TimerHandle | None = None
        self._lapse: asyncio.TimerHandle | None = None  # the lease's end, watched (_lapsed)
        self._exit: Exit | None = None  # the exit reported, awaiting the report's end
        self._exit_wait: asyncio.TimerHandle | None = None
        self.started: asyncio.Future[None] = loop.create_future()
        self.ended: asyncio.Future[Exit] = loop.create_future()
        os.set_blocking(report, False)
        os.set_blocking(ctl, False)
        loop.add_reader(report, self._readable)

    # -- steering -----------------------------------------------------------------------------

    def renew(self, until: float) -> None:
        """The lease lasts until `until` (time.monotonic()); thaws a frozen tree. The shim is
        told what is left of it as it is sent."""
        self._cancel_unlease()
        self._send(f"renew {max(until - time.monotonic(), 0.0):.3f}")
        self.leased(until)

    def leased(self, until: float) -> None:
        """The shim was told the lease lasts until `until`: watched (`_lapsed`)."""
        self._expiry = until
        if self._lapse is not None:
            self._lapse.cancel()
        delay = max(until - time.monotonic(), 0.0) + LAPSE_ANSWER_S
        self._lapse = asyncio.get_running_loop().call_later(delay, self._lapsed)

    def _lapsed(self) -> None:
        """The lease ran out and the shim has not said it froze the tree. A shim found
        stopped (by its task: SIGSTOP to its parent) never will, and the tree would run on
        unleased beside the task's next run: it is killed from the executor. One merely slow
        is looked at again (a renewal may yet thaw what it freezes)."""
        if self._expiry is None or time.monotonic() < self._expiry or self.frozen:
            return
        shim = proctree.stat(self.shim_pid) if self.shim_pid > 0 else None
        if shim is not None and shim.state in ("T", "t"):
            self._force("its lease's end")
        elif not self.ended.done():
            self._lapse = asyncio.get_running_loop().call_later(LAPSE_ANSWER_S, self._lapsed)

    def lease_job(self, until: float) -> None:
        """A handler worker's next job, whose lease lasts until `until` (time.monotonic()).
        The shim still holds what it was told for the worker's previous job; when that ends
        no later than this job's lease and at most JOB_SLACK_S sooner, it is left as it is:
        the shim then freezes no later than this lease allows, and the executor's renewals
        (every quarter of a lease at most) extend it long before. Under load a worker takes
        jobs milliseconds apart, most of them claimed by one statement and so with one lease
        end: this saves a write, and a wake of the shim, per job."""
        self._cancel_unlease()
        slack = min(JOB_SLACK * max(until - time.monotonic(), 0.0), JOB_SLACK_S)
        told = self._expiry
        if told is None or self.frozen or not until - slack <= told <= until:
            self.renew(until)

    def unlease(self) -> None:
        """No lease is kept (an idle handler worker): never frozen."""
        self._cancel_unlease()
        self._send("unlease")
        self._expiry = None
        if self._lapse is not None:
            self._lapse.cancel()

    def unlease_soon(self) -> None:
        """An idle handler worker: drop its lease shortly before it would freeze it — unless
        its next job renews it first, as under load it does within milliseconds. That saves a
        write, and a wake of the shim, per job; a worker idle when its lease runs out (this
        executor frozen) is frozen idle, and thawed by its next job's renewal."""
        if self._expiry is None or self._unlease is not None:
            return
        delay = max(0.0, self._expiry - time.monotonic() - UNLEASE_AHEAD_S)
        self._unlease = asyncio.get_running_loop().call_later(delay, self.unlease)

    def _cancel_unlease(self) -> None:
        if self._unlease is not None:
            self._unlease.cancel()
            self._unlease = None

    def stop(self, grace_s: float) -> None:
        """SIGTERM the process group, SIGKILL the whole tree after `grace_s`."""
        self._send(f"stop {grace_s:.3f}")
        self._force_after(grace_s + SHIM_ANSWER_S)

    def kill(self) -> None:
        """SIGKILL the whole tree now."""
        self._send("kill")
        self._force_after(SHIM_ANSWER_S)

    def _force_after(self, delay: float) -> None:
        if self._force_at is None and not self.ended.done():
            self._force_at = asyncio.get_running_loop().call_later(delay, self._force)

    def _force(self, what: str = "a stop") -> None:
        """The shim did not answer a stop or a kill in time: a task can stop its own shim
        (its parent), which then neither kills the tree nor reports. SIGKILL the leader's
        process group, then the shim (which SIGKILL ends even stopped); the report pipe's end
        then ends this tree as lost. Neither pid can have been reused: a stopped shim reaps
        nothing, and it is this shim's until its exit was reported."""
        if self.ended.done() or self._exit is not None:
            return
        log.warning(
            "shim %d of process %d did not answer %s in time (stopped by its task?): "
            "killing them from the executor",
            self.shim_pid,
            self.pid,
            what,
        )
        for kill, pid in ((os.killpg, self.pid), (os.kill, self.shim_pid)):
            if pid > 0:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)

    def nudge(self) -> None:
        """SIGUSR1 to the tree's leader (a handler worker: give back what you have not
        started); its shim sends it, which cannot meanwhile have reaped that pid."""
        self._send("nudge")

    async def wait(self) -> Exit:
        return await asyncio.shield(self.ended)

    def _send(self, line: str) -> None:
        if self.ended.done():
            return
        try:
            os.write(self._ctl, line.encode() + b"\n")
        except (BlockingIOError, BrokenPipeError) as exc:  # the shim is gone, or wedged
            log.warning("shim of process %d did not take %r: %s", self.pid, line, exc)

    # -- reports ------------------------------------------------------------------------------

    def _readable(self) -> None:
        try:
            data = os.read(self._report, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            if self._exit is None:  # killed (by its task?): its warden reaps what it left,
                self._vanished()  # unless that task stopped the warden first
            self._end(self._exit or Exit(None, "lost"))
            return
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._line(line.decode(errors="replace"))

    def _line(self, line: str) -> None:
        word, _, rest = line.partition(" ")
        if word == "pid":
            pid, started, shim = [*rest.split(), "0", "0"][:3]
            self.pid, self.start_time, self.shim_pid = int(pid), int(started), int(shim)
            if not self.started.done():
                self.started.set_result(None)
        elif word == "error":  # the leader did not start its program; the report's end follows
            self.error = str(json.loads(rest))
        elif word == "frozen":
            self.frozen = True
            log.warning("process %d frozen: its lease was not renewed in time", self.pid)
        elif word == "thawed":
            self.frozen = False
            log.info("process %d thawed: its lease was renewed", self.pid)
        elif word == "exit":
            status, _, how = rest.partition(" ")
            raw = int(status)
            self._exit = Exit(None if raw < 0 else os.waitstatus_to_exitcode(raw), how)
            # ended at the report's end, which the shim closes right after this line with the
            # attempt's other descriptors: the outcome is then known only once they are
            # closed and the shim has told the warden it is idle for the next attempt
            loop = asyncio.get_running_loop()
            self._exit_wait = loop.call_later(EXIT_EOF_S, self._end, self._exit)

    def abandon(self) -> None:
        """Forget a spawn that was never answered: with its pipes closed, a shim that does
        answer later finds the executor gone and kills what it started."""
        self._end(Exit(None, "lost"))
        if self.started.done() and not self.started.cancelled():
            self.started.exception()  # retrieved: nothing waits for it now

    def _end(self, result: Exit) -> None:
        self._cancel_unlease()
        for timer in (self._exit_wait, self._force_at, self._lapse):
            if timer is not None:
                timer.cancel()
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._report)
        for fd in (self._report, self._ctl):
            with contextlib.suppress(OSError):
                os.close(fd)
        if not self.started.done():
            why = self.error or f"the shim ended first ({result.how})"
            self.started.set_exception(SpawnError(why))
        if not self.ended.done():
            self.ended.set_result(result)


class Warden:
    """The warden process of one executor, and the socket that asks it to spawn."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._closing = False

    async def start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",  # the working directory does not go on sys.path
                "-m",
                "services.executor.warden",
                str(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C or Ctrl-Z never reaches it
                env=without_secrets(os.environ),
            )
        finally:
            theirs.close()
        mine.setblocking(False)
        self._sock = mine

    async def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: str | None = None,
        log_path: Path | None = None,
        lease_s: float | None = None,
        freeze_max_s: float = 600.0,
        pipes: tuple[int, int] | None = None,
    ) -> Proc:
        """Start `argv` under a shim of its own; returns once it is forked, with its pid. Its
        output goes to `log_path`, or stdin and stdout are `pipes` (their far ends; they are
        closed here). A program that could not start ends at once with `Proc.error` set;
        SpawnError if no shim answered within SPAWN_ANSWER_S."""
        if self._sock is None or self._closing:
            raise SpawnError("the warden is not running")
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        request = {
            "argv": list(argv),
            "env": dict(env),
            "cwd": cwd,
            "log": None if log_path is None else str(log_path),
            "lease_s": lease_s,
            "freeze_max_s": freeze_max_s,
        }
        passed = [ctl_r, report_w, *(pipes or ())]
        try:
            proc = Proc(ctl_w, report_r, self.continue_stopped)
            if lease_s is not None:
                proc.leased(time.monotonic() + lease_s)
            body = json.dumps(request).encode()
            async with self._lock:
                await self._send(wire.frame(body), passed)
        except BaseException:
            for fd in (ctl_w, report_r):
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        finally:
            for fd in passed:
                os.close(fd)
        try:
            async with asyncio.timeout(SPAWN_ANSWER_S):
                await proc.started
        except TimeoutError:
            proc.abandon()
            self.continue_stopped()
            raise SpawnError(
                f"no shim answered in {SPAWN_ANSWER_S:g} s (one stopped by a process of the "
                "executor's user?)"
            ) from None
        except BaseException:
            proc.abandon()
            raise
        return proc

    def continue_stopped(self) -> None:
        """SIGCONT the warden and its shims where stopped (proctree.continue_stopped): a
        stopped warden or idle shim answers no spawn. A request they held then finds its
        pipes closed (Proc.abandon): its leader's first write fails, and nothing runs."""
        if self._proc is not None:
            for pid in proctree.continue_stopped(self._proc.pid):
                log.error("process %d of the warden was stopped (by a task?): continued", pid)

    async def _send(self, data: bytes, fds: list[int]) -> None:
        """Send `data` with `fds` attached to its first byte, without blocking the loop."""
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        while True:
            try:
                sent = self._sock.sendmsg([data], rights)
                break
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_writer(self._sock, ready.set_result, None)
                try:
                    await ready
                finally:
                    loop.remove_writer(self._sock)
        if sent < len(data):
            await loop.sock_sendall(self._sock, data[sent:])

    async def watch(self) -> None:
        """Return only by raising: when the warden dies while it is still needed."""
        assert self._proc is not None
        code = await self._proc.wait()
        if not self._closing:
            raise RuntimeError(f"the warden died ({exit_text(code)}): its attempts died with it")

    async def close(self) -> None:
        """Stop the warden: every shim kills its tree first (bounded)."""
        self._closing = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None and self._proc.returncode is None:
            try:
                await asyncio.wait_for(self._proc.wait(), KILL_ROUNDS_S + 5)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
