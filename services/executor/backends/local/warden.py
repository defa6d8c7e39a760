"""The warden: a small process per executor that starts attempts and holds their leases.

`python -m services.executor.backends.local.warden FD` — FD is a Unix stream socket to the
executor. For each request (a length-prefixed JSON spawn request, with file descriptors
attached) the warden forks a *shim*: a supervisor of one process tree that

- starts the attempt's process (its own process group, SIGKILLed if the shim dies) and is a
  child subreaper, so whatever the process starts — daemons that call setsid included — stays
  below it and is found and killed when the attempt ends;
- keeps the attempt's lease: the executor writes `renew SECONDS` each time Postgres has
  renewed the lease; if none arrives in time, the shim freezes the whole tree (SIGSTOP) on
  its own, without the executor (which may be frozen, partitioned or dead). `renew` again
  thaws it; `kill` (the attempt was superseded), the executor's death, or staying frozen
  past `freeze_max_s` kills it;
- reports to the executor on a pipe: `pid N START`, `frozen`, `thawed`, `exit STATUS HOW`.

Only the standard library, and fork rather than exec: a shim costs a fork of this small
process, not a Python start. Why our own: no library supervises a process tree with a lease
that must hold while its parent is frozen; see docs/architecture.md for the timing argument.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Any, NamedTuple

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
HEADER = struct.Struct("!I")
MAX_FDS = 4
KILL_ROUNDS_S = 5.0  # how long a shim keeps killing a tree whose members will not die


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _now() -> float:
    return time.monotonic()


# --- process trees --------------------------------------------------------------------------


class Stat(NamedTuple):
    state: str  # R, S, D, T (stopped), Z (zombie), ...
    ppid: int
    pgid: int
    start_time: int  # ticks since boot: tells a process from a later one given the same pid


def stat(pid: int) -> Stat | None:
    """A process's line of /proc/<pid>/stat, or None if it is gone (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its last ")".
    fields = raw[raw.rindex(b")") + 2 :].split()
    return Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))


def start_time(pid: int) -> int | None:
    found = stat(pid)
    return None if found is None else found.start_time


def descendants(root: int) -> list[int]:
    """Every live process below `root`, parents before children (a scan of /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = stat(int(name))
            if found is not None and found.state not in ("Z", "X"):
                children.setdefault(found.ppid, []).append(int(name))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal(pid: int, sig: int, *, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(pid, sig)


# --- the shim: one attempt's tree --------------------------------------------------------------


class _Terminated(Exception):
    """SIGTERM: the warden is going (or gone: the shim's parent-death signal)."""


def _on_term(_sig: int, _frame: object) -> None:
    raise _Terminated


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

    def run(self, warden: int) -> int:
        os.setsid()  # out of the warden's session: its job control never reaches the tree
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != warden:
            return 1  # the warden died before the parent-death signal was armed
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, _on_term)
        try:
            if not self._start():
                return 0
            self._supervise(wake_r)
        except _Terminated:
            self.how = "terminated"
        self._kill_tree()
        self._say(f"exit {self.status if self.status is not None else -1} {self.how}")
        return 0

    def _say(self, line: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self.report, line.encode() + b"\n")

    def _start(self) -> bool:
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        shim = os.getpid()
        self.leader = os.fork()
        if self.leader == 0:
            os.close(err_r)
            _exec_leader(self.req, self.pipes, err_w, shim)
        os.close(err_w)
        for fd in self.pipes:
            os.close(fd)
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
        self._say(f"pid {self.leader} {start_time(self.leader) or 0}")
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
            self.expiry = _now() + float(words[1])
            self._thaw()
        elif words[0] == "unlease":
            self.expiry = None
            self._thaw()
        elif words[0] == "stop":  # SIGTERM, then SIGKILL after the grace
            self.how = "stopped"
            self._thaw()
            _signal(self.leader, signal.SIGTERM, group=True)
            self.kill_at = _now() + float(words[1])
        elif words[0] == "kill":
            self.how = "killed"
            return True
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
                _signal(self.leader, signal.SIGKILL, group=True)
                self.status = os.waitpid(self.leader, 0)[1]
            else:
                os.waitpid(info.si_pid, 0)

    def _freeze(self) -> None:
        """SIGSTOP the whole tree: a process forking meanwhile is caught by the next scan,
        and a stopped process cannot fork, so this ends."""
        self.frozen_at = _now()
        _signal(self.leader, signal.SIGSTOP, group=True)
        stopped: set[int] = set()
        for _ in range(100):
            fresh = [p for p in descendants(os.getpid()) if p not in stopped]
            if not fresh:
                break
            for pid in fresh:
                _signal(pid, signal.SIGSTOP)
            stopped.update(fresh)
        self._say("frozen")

    def _thaw(self) -> None:
        if self.frozen_at is None:
            return
        self.frozen_at = None
        _signal(self.leader, signal.SIGCONT, group=True)
        for pid in descendants(os.getpid()):
            _signal(pid, signal.SIGCONT)
        self._say("thawed")

    def _kill_tree(self) -> None:
        """SIGKILL the leader's group and everything below this shim, and reap it all."""
        if self.leader <= 0:
            return
        if self.status is None:
            _signal(self.leader, signal.SIGKILL, group=True)
        deadline = _now() + KILL_ROUNDS_S
        while not self._reap() and _now() < deadline:
            # orphans of the tree are this subreaper's children now; kill all that live
            for pid in descendants(os.getpid()):
                _signal(pid, signal.SIGKILL)
            time.sleep(0.01)


def _exec_leader(req: dict[str, Any], pipes: list[int], err: int, shim: int) -> None:
    """In the forked leader: set up and exec the attempt's program; never returns."""
    where: str | None = None  # what an OSError is about, as `subprocess` names it
    try:
        os.setpgid(0, 0)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != shim:
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if pipes:
            os.dup2(pipes[0], 0)
            os.dup2(pipes[1], 1)
        else:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
        os.closerange(3, err)
        os.closerange(err + 1, 1 << 16)
        if req.get("cwd"):
            where = req["cwd"]
            os.chdir(req["cwd"])
        argv = req["argv"]
        where = argv[0]
        os.execvpe(argv[0], argv, req["env"])
    except BaseException as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            text = f"[Errno {exc.errno}] {os.strerror(exc.errno)}: {where or exc.filename!r}"
        else:
            text = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):
            os.write(err, text.encode(errors="replace"))
    os._exit(127)


# --- the warden ------------------------------------------------------------------------------


class Warden:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.shims: set[int] = set()
        self.me = os.getpid()

    def serve(self) -> None:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # a shim that dies leaves its tree to us: killed
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor decides when we stop
        signal.signal(signal.SIGTERM, _on_term)
        try:
            while True:
                ready, _, _ = select.select([self.sock.fileno(), wake_r], [], [])
                if wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake_r, 512):
                            pass
                    self._reap()
                if self.sock.fileno() in ready and not self._request(wake_r, wake_w):
                    break  # the executor closed the socket, or died
        except _Terminated:
            pass
        self._shutdown()

    def _request(self, wake_r: int, wake_w: int) -> bool:
        msg, fds, _flags, _addr = socket.recv_fds(self.sock, HEADER.size, MAX_FDS)
        while 0 < len(msg) < HEADER.size:
            chunk = self.sock.recv(HEADER.size - len(msg))
            if not chunk:
                break
            msg += chunk
        if len(msg) < HEADER.size:  # the executor closed the socket, or died
            for fd in fds:
                os.close(fd)
            return False
        (size,) = HEADER.unpack(msg)
        body = b""
        while len(body) < size:
            chunk = self.sock.recv(size - len(body))
            if not chunk:
                return False
            body += chunk
        req = json.loads(body)
        pid = os.fork()
        if pid == 0:  # the shim
            code = 1
            try:
                self.sock.close()
                os.close(wake_r)
                os.close(wake_w)
                signal.set_wakeup_fd(-1)
                code = Shim(req, fds).run(self.me)
            finally:
                os._exit(code)
        self.shims.add(pid)
        for fd in fds:
            os.close(fd)
        return True

    def _reap(self) -> None:
        orphans = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in self.shims:
                self.shims.discard(pid)
                orphans = orphans or not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
            else:
                orphans = True  # an orphan we killed: its own children are ours now
        if orphans:
            self._kill_orphans()

    def _kill_orphans(self) -> None:
        """A shim that died abruptly left its tree to this subreaper: none of it may live."""
        for pid in descendants(self.me):
            # only what hangs below a dead shim: a live shim's tree is its own business
            if pid not in self.shims and not self._below_live_shim(pid):
                _signal(pid, signal.SIGKILL)

    def _below_live_shim(self, pid: int) -> bool:
        for _ in range(1000):
            found = stat(pid)
            if found is None or found.ppid in (0, 1):
                return False
            if found.ppid in self.shims:
                return True
            if found.ppid == self.me:
                return False
            pid = found.ppid
        return False

    def _shutdown(self) -> None:
        """Every shim kills its tree; those that do not in time are killed with it."""
        for pid in self.shims:
            _signal(pid, signal.SIGTERM)
        deadline = _now() + KILL_ROUNDS_S + 1
        while self.shims and _now() < deadline:
            self._reap()
            time.sleep(0.01)
        for pid in self.shims:
            _signal(pid, signal.SIGKILL)
        for _ in range(100):
            self._reap()
            rest = descendants(self.me)
            if not rest:
                break
            for pid in rest:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.01)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    Warden(sock).serve()


if __name__ == "__main__":
    main()
