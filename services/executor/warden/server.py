"""The warden's fork server: takes spawn requests from the executor over a Unix socket
(length-prefixed JSON, file descriptors attached) and forks a shim for each; as subreaper of
the shims it kills whatever a shim that died abruptly left behind, and when the executor goes
it has every shim kill its tree."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import struct
import time

from services.executor.warden.proctree import (
    PR_SET_CHILD_SUBREAPER,
    descendants,
    prctl,
    signal_,
    stat,
)
from services.executor.warden.shim import KILL_ROUNDS_S, Shim, Terminated, on_term

HEADER = struct.Struct("!I")
MAX_FDS = 4


class Warden:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.shims: set[int] = set()
        self.me = os.getpid()

    def serve(self) -> None:
        # Every shim is a fork of this process: objects the collector would walk in a child
        # are pages copied in it. Frozen, they are left alone (the prefork servers' remedy).
        gc.freeze()
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # a shim that dies leaves its tree to us: killed
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor decides when we stop
        signal.signal(signal.SIGTERM, on_term)
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
        except Terminated:
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
