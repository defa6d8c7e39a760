"""The warden's fork server: takes spawn requests from the executor over a Unix socket
(length-prefixed JSON, file descriptors attached) and hands each to an idle shim, forking one
when none is idle; as subreaper of the shims it kills whatever a shim that died abruptly left
behind, and when the executor goes it has every shim kill its tree."""

from __future__ import annotations

import contextlib
import gc
import os
import selectors
import signal
import socket
import time

from services.executor.warden.proctree import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_DUMPABLE,
    descendants,
    prctl,
    signal_,
    stat,
)
from services.executor.warden.shim import IDLE, KILL_ROUNDS_S, Terminated, on_term, serve
from services.executor.warden.wire import receive, send

# Idle shims kept beyond this are let go: a burst's shims stay for the next burst, within reason.
MAX_IDLE = 64


class Warden:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.shims: set[int] = set()  # every live shim, busy or idle
        self.links: dict[int, socket.socket] = {}  # shim pid -> the warden's end of its socket
        self.idle: list[int] = []  # shims waiting for an attempt, the most recent last
        self.me = os.getpid()
        self.selector = selectors.DefaultSelector()

    def serve(self) -> None:
        # Every shim is a fork of this process: objects the collector would walk in a child
        # are pages copied in it. Frozen, they are left alone (the prefork servers' remedy).
        gc.freeze()
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # a shim that dies leaves its tree to us: killed
        # Closed to the other processes of our user — the tasks among them — as the services
        # are (shared.runtime.keep_private), and so is every shim, forked from here: their
        # /proc/<pid>/fd would open any attempt's pipes to the executor, to forge its exit
        # ("exit 0"), kill it or renew its lease. A leader's exec makes it dumpable again.
        prctl(PR_SET_DUMPABLE, 0)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor decides when we stop
        signal.signal(signal.SIGTERM, on_term)
        self.selector.register(self.sock, selectors.EVENT_READ, None)
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        serving = True
        try:
            while serving:
                for key, _ in self.selector.select():
                    if key.fileobj == self.wake_r:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(self.wake_r, 512):
                                pass
                        self._reap()
                    elif key.fileobj is self.sock:
                        # False: the executor closed the socket, or died
                        serving = serving and self._request()
                    else:
                        self._heard(key.data)
        except Terminated:
            pass
        self._shutdown()

    def _request(self) -> bool:
        got = receive(self.sock)
        if got is None:
            return False
        request, fds = got
        try:
            if not self.idle:
                # a shim says it is idle before it reports its attempt's exit, so a request
                # sent on that report finds the word already on its link: read it, not fork
                for key, _ in self.selector.select(timeout=0):
                    if isinstance(key.data, int):
                        self._heard(key.data)
            while self.idle:
                pid = self.idle.pop()
                try:
                    send(self.links[pid], request, fds)
                    return True
                except OSError:  # it died idle: its exit is reaped in its turn
                    self._unlink(pid)
            self._fork(request, fds)
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _fork(self, request: bytes, fds: list[int]) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:  # the shim
            code = 1
            try:
                mine.close()
                # nothing of the warden's: its socket, its selector, other shims' links
                self.selector.close()
                self.sock.close()
                for link in self.links.values():
                    link.close()
                os.close(self.wake_r)
                os.close(self.wake_w)
                signal.set_wakeup_fd(-1)
                code = serve(self.me, theirs, request, fds)
            finally:
                os._exit(code)
        theirs.close()
        self.shims.add(pid)
        self.links[pid] = mine
        self.selector.register(mine, selectors.EVENT_READ, pid)

    def _heard(self, pid: int) -> None:
        """A shim's link is readable: it is idle again, or gone."""
        link = self.links.get(pid)
        if link is None:
            return  # unlinked earlier in this round
        try:
            # not blocking: a request may have read this link already (the round's list of
            # readable links is older than that read)
            said = link.recv(64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            said = b""
        if said == IDLE and len(self.idle) < MAX_IDLE:
            self.idle.append(pid)
        else:  # gone, idle beyond need, or talking nonsense: closing its link lets it go
            self._unlink(pid)

    def _unlink(self, pid: int) -> None:
        link = self.links.pop(pid, None)
        if link is not None:
            self.selector.unregister(link)
            link.close()
        with contextlib.suppress(ValueError):
            self.idle.remove(pid)

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
                self._unlink(pid)
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
                signal_(pid, signal.SIGKILL)

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
            signal_(pid, signal.SIGTERM)
        deadline = time.monotonic() + KILL_ROUNDS_S + 1
        while self.shims and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.01)
        for pid in self.shims:
            signal_(pid, signal.SIGKILL)
        for _ in range(100):
            self._reap()
            rest = descendants(self.me)
            if not rest:
                break
            for pid in rest:
                signal_(pid, signal.SIGKILL)
            time.sleep(0.01)
