"""The shim: the supervisor of one attempt at a time, forked by the warden and kept for the
next (see the package doc). The attempt's process tree runs below it; it keeps the attempt's
lease on this host's monotonic clock and freezes the tree when no renewal arrived in time,
without the executor."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from services.executor.warden.proctree import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    descendants,
    prctl,
    signal_,
    start_time,
    stat,
)
from services.executor.warden.wire import decode, receive

# Put back to the default in a command's leader: what the shim handles, and every signal
# ignored here (Python's SIGPIPE and SIGXFSZ; nohup's SIGHUP; SIGQUIT in a background job),
# which would stay so across exec. Read once: ~60 µs in each leader.
_SHIMS = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
_RESET = (*_SHIMS, *(s for s in signal.valid_signals() if signal.getsignal(s) is signal.SIG_IGN))
KILL_ROUNDS_S = 5.0  # how long a shim keeps killing a tree whose members will not die


def _now() -> float:
    return time.monotonic()


class Terminated(Exception):
    """SIGTERM: the warden is going (or gone: the shim's parent-death signal)."""


def on_term(_sig: int, _frame: object) -> None:
    raise Terminated


class Shim:
    """Runs in a child the warden forked: supervises one process tree (see the module doc)."""

    def __init__(self, req: dict[str, Any], fds: list[int]) -> None:
        self.req = req
        self.ctl, self.report = fds[0], fds[1]
        self.pipes = fds[2:]  # a handler worker's stdin and stdout
        self.leader = 0
        self.status: int | None = None  # the leader's wait status, once reaped
        self.how = "exited"
        self.expiry: float | None = None
        self.frozen_at: float | None = None
        self.kill_at: float | None = None  # after a graceful stop: SIGKILL from here
        self.freeze_max = float(req.get("freeze_max_s", 600.0))
        self.clean = True  # False: some of the tree would not die

    def attend(self, wake: int, idle: Callable[[], None]) -> bool:
        """Start the attempt and supervise it to its end, then kill and reap what is left of
        its tree. True when this shim may serve another attempt: nothing of the tree is left,
        and neither the warden nor the executor is going — and then `idle` is called before
        the exit is reported, with the attempt's other descriptors closed: an executor that
        has the outcome (at the report's end) finds this shim idle for its next attempt."""
        try:
            if not self._start():
                self._close()
                return True  # the program did not start: its leader is reaped, nothing ran
            self._supervise(wake)
        except Terminated:
            self.how = "terminated"
        self.clean = self._kill_tree()
        reusable = self.clean and self.how not in ("terminated", "orphaned")
        self._close(but_report=True)
        if reusable:
            idle()
        self._say(f"exit {self.status if self.status is not None else -1} {self.how}")
        self._close()
        return reusable

    def _close(self, but_report: bool = False) -> None:
        """This attempt's pipes to the executor: closed, so that none outlives its attempt
        (each once: a closed one is -1, its number free for reuse)."""
        fds = [self.ctl, *self.pipes] if but_report else [self.ctl, self.report, *self.pipes]
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.ctl, self.pipes = -1, []
        if not but_report:
            self.report = -1

    def _say(self, line: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self.report, line.encode() + b"\n")

    def _start(self) -> bool:
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        shim = os.getpid()
        program = resolve(self.req["argv"][0], self.req["env"])
        self.leader = os.fork()
        if self.leader == 0:
            os.close(err_r)
            exec_leader(self.req, self.pipes, err_w, shim, self.report, program)
        os.close(err_w)
        for fd in self.pipes:
            os.close(fd)
        self.pipes = []
        failure = b""
        while chunk := os.read(err_r, 4096):  # closed by a successful exec
            failure += chunk
        os.close(err_r)
        if failure:
            os.waitpid(self.leader, 0)
            self._say("error " + json.dumps(failure.decode(errors="replace")))
            return False
        lease = self.req.get("lease_s")
        if lease is not None:
            self.expiry = _now() + float(lease)
        return True

    def _supervise(self, wake: int) -> None:
        pending = b""
        while True:
            ready, _, _ = select.select([self.ctl, wake], [], [], self._timeout())
            if wake in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake, 512):
                        pass
            self._reap()
            if self.status is not None:
                return  # the leader has exited
            if self.ctl in ready:
                data = os.read(self.ctl, 4096)
                if not data:  # the executor is gone: so is everything it ran
                    self.how = "orphaned"
                    return
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if self._command(line.decode().split()):
                        return
            now = _now()
            if self.expiry is not None and self.frozen_at is None and now >= self.expiry:
                self._freeze()
            if self.frozen_at is not None and now >= self.frozen_at + self.freeze_max:
                self.how = "frozen too long"
                return
            if self.kill_at is not None and now >= self.kill_at:
                return

    def _timeout(self) -> float | None:
        due = [
            t
            for t in (
                self.expiry if self.frozen_at is None else None,
                None if self.frozen_at is None else self.frozen_at + self.freeze_max,
                self.kill_at,
            )
            if t is not None
        ]
        return max(0.0, min(due) - _now()) if due else None

    def _command(self, words: list[str]) -> bool:
        """One line from the executor; True when the tree is to be killed now."""
        if not words:
            return False
        if words[0] == "renew":
            left = float(words[1])
            self.expiry = _now() + left
            if left > 0:
                # A lease already over (a renewal applied too late: its statement was sent
                # before the executor froze) thaws nothing: the attempt's successor may run
                # elsewhere by now, and the next tick would only freeze it again.
                self._thaw()
        elif words[0] == "unlease":
            self.expiry = None
            self._thaw()
        elif words[0] == "stop":  # SIGTERM, then SIGKILL after the grace
            if self.frozen_at is not None:
                # Frozen: its lease lapsed, and a next attempt may run elsewhere by now. A
                # graceful stop would thaw it to take SIGTERM and let it run beside that
                # attempt for the grace; SIGKILL ends a stopped process as it stands.
                self.how = "killed"
                return True
            self.how = "stopped"
            self._thaw()
            signal_(self.leader, signal.SIGTERM, group=True)
            self.kill_at = _now() + float(words[1])
        elif words[0] == "kill":
            self.how = "killed"
            return True
        elif words[0] == "nudge":  # a handler worker: give back the jobs it has not started
            signal_(self.leader, signal.SIGUSR1)  # a frozen one answers once thawed
        return False

    def _reap(self) -> bool:
        """Reap every child that has ended; True once none is left at all.

        The leader is looked at before it is reaped (WNOWAIT): while its zombie holds its pid,
        the pid still names its process group, which is SIGKILLed then — what it left running
        in its group ends with it, and the group id cannot meanwhile name another group."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return True
            if info is None:
                return False
            if info.si_pid == self.leader and self.status is None:
                signal_(self.leader, signal.SIGKILL, group=True)
                self.status = os.waitpid(self.leader, 0)[1]
            else:
                os.waitpid(info.si_pid, 0)

    def _freeze(self) -> None:
        """SIGSTOP the whole tree, scanning again until every process of it is seen stopped:
        a process forking meanwhile is caught by the next scan, and one that a process not
        yet stopped continued (SIGCONT) is stopped again; a stopped process can neither fork
        nor continue another, so this ends once all are stopped at once."""
        self.frozen_at = _now()
        signal_(self.leader, signal.SIGSTOP, group=True)
        for _ in range(FREEZE_SCANS):
            running = [p for p in descendants(os.getpid()) if _runs(p)]
            if not running:
                break
            for pid in running:
                signal_(pid, signal.SIGSTOP)
            time.sleep(0.001)  # a stop is delivered asynchronously: let it land before a look
        self._say("frozen")

    def _thaw(self) -> None:
        if self.frozen_at is None:
            return
        self.frozen_at = None
        signal_(self.leader, signal.SIGCONT, group=True)
        for pid in descendants(os.getpid()):
            signal_(pid, signal.SIGCONT)
        self._say("thawed")

    def _kill_tree(self) -> bool:
        """SIGKILL the leader's group and everything below this shim, and reap it all; False
        if some of it would not die within KILL_ROUNDS_S."""
        if self.leader <= 0:
            return True
        if self.status is None:
            signal_(self.leader, signal.SIGKILL, group=True)
        deadline = _now() + KILL_ROUNDS_S
        while not (done := self._reap()) and _now() < deadline:
            # orphans of the tree are this subreaper's children now; kill all that live
            for pid in descendants(os.getpid()):
                signal_(pid, signal.SIGKILL)
            time.sleep(0.01)
        return done


FREEZE_SCANS = 200  # a tree that keeps continuing itself is stopped again, this many times


def _runs(pid: int) -> bool:
    """Whether `pid` is alive and not stopped (T: stopped, t: stopped by a tracer)."""
    found = stat(pid)
    return found is not None and found.state not in ("T", "t", "Z", "X")


IDLE = b"i"  # shim -> warden: my attempt is over and its tree is gone; send me the next


def serve(warden: int, link: socket.socket, request: bytes, fds: list[int]) -> int:
    """A shim's life, in the child the warden forked for `request`: attend that
    attempt, then each one the warden hands over `link`, for as long as every attempt's tree
    is gone when it ends. Returns the exit status: non-zero asks the warden, as subreaper, to
    kill what is left.

    Why shims are kept: a fresh fork of a Python process per attempt, and the pages it copies
    as it runs, cost more than the attempt's own fork and exec (about 2 ms of CPU of a `true`
    command's 4, docs/performance.md). A shim holds no state of one attempt into the next:
    each gets a new Shim, its own pipes, and a tree reaped to the last process before the
    shim says it is idle."""
    os.setsid()  # out of the warden's session: its job control never reaches the tree
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != warden:
        return 1  # the warden died before the parent-death signal was armed
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, on_term)
    told: bool | None = None  # this attempt: idle said (True), or the warden not told (False)

    def idle() -> None:
        nonlocal told
        try:
            link.sendall(IDLE)
            told = True
        except (Terminated, OSError):  # never in the way of the exit's report
            told = False

    while True:
        shim = Shim(decode(request), fds)
        told = None
        if not shim.attend(wake_r, idle):
            return 0 if shim.how in ("terminated", "orphaned") and shim.clean else 1
        if told is None:
            idle()  # the program did not start: its error was reported, nothing ran
        if not told:
            return 0  # told to go, or the warden is gone
        try:
            got = receive(link)
        except (Terminated, OSError):
            return 0  # told to go while idle, or the warden is gone
        if got is None:
            return 0  # the warden has idle shims enough, or is going
        request, fds = got


def resolve(name: str, env: dict[str, str]) -> str | None:
    """The file `execvpe` would run for `name`, found before the fork (None: let execvpe
    search, and report, in the leader). Searching PATH after the fork cost about 1 ms a
    launch: each step of os.execvpe's Python loop writes to pages the fork shares, and
    every page written is copied. Only an absolute PATH is searched here, as the leader's
    working directory may differ."""
    if "/" in name:
        return None
    path = env.get("PATH", os.defpath)
    if not all(os.path.isabs(d) for d in path.split(os.pathsep)):
        return None
    return shutil.which(name, path=path)


def exec_leader(
    req: dict[str, Any],
    pipes: list[int],
    err: int,
    shim: int,
    report: int,
    program: str | None = None,
) -> None:
    """In the forked leader: report the pids, set up and exec the attempt's program; never
    returns."""
    where: str | None = None  # what an OSError is about, as `subprocess` names it
    try:
        os.setpgid(0, 0)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != shim:
            os._exit(1)
        # The pids go out from here, before the program can run, not from the shim after the
        # fork: on a loaded host the leader may exec and run before the shim runs again, and
        # a program that stops its shim (its parent) at once is killed from the executor
        # (Proc._force), which has no other way to find the tree.
        me = os.getpid()
        os.write(report, f"pid {me} {start_time(me) or 0} {shim}\n".encode())
        signal.set_wakeup_fd(-1)
        for sig in _RESET:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if pipes:
            os.dup2(pipes[0], 0)
            os.dup2(pipes[1], 1)
        else:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            # made anew: whatever an earlier attempt put at this (findable) path — a FIFO
            # whose open would wait forever, a symlink to another file — is not opened
            try:
                os.unlink(req["log"])
            except FileNotFoundError:
                pass
            except IsADirectoryError:  # a task may plant one at another attempt's log path
                shutil.rmtree(req["log"], ignore_errors=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND
            log = os.open(req["log"], flags, 0o600)
            os.dup2(log, 1)
            os.dup2(log, 2)
        os.closerange(3, err)
        os.closerange(err + 1, 1 << 16)
        if req.get("cwd"):
            where = req["cwd"]
            os.chdir(req["cwd"])
        argv = req["argv"]
        where = argv[0]
        if program is not None:
            with contextlib.suppress(OSError):  # as execvpe would, look further on failure
                os.execve(program, argv, req["env"])
        os.execvpe(argv[0], argv, req["env"])
    except BaseException as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            text = f"[Errno {exc.errno}] {os.strerror(exc.errno)}: {where or exc.filename!r}"
        else:
            text = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):
            os.write(err, text.encode(errors="replace"))
    os._exit(127)
