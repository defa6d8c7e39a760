"""The warden's framing: a spawn request is a 4-byte length, then that much JSON, with the
attempt's file descriptors attached to its first byte. The executor sends them to the warden,
and the warden hands them on to an idle shim in the same form."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from typing import Any

HEADER = struct.Struct("!I")
MAX_FDS = 4


def send(sock: socket.socket, request: bytes, fds: list[int]) -> None:
    """A framed request with `fds` attached (a blocking socket; requests are small)."""
    socket.send_fds(sock, [HEADER.pack(len(request)) + request], fds)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One framed request and its descriptors; None when the other end closed (or sent a
    truncated frame: it died mid-send)."""
    msg, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, MAX_FDS)
    while 0 < len(msg) < HEADER.size:
        chunk = sock.recv(HEADER.size - len(msg))
        if not chunk:
            break
        msg += chunk
    body = b""
    if len(msg) == HEADER.size:
        (size,) = HEADER.unpack(msg)
        while len(body) < size:
            chunk = sock.recv(size - len(body))
            if not chunk:
                break
            body += chunk
        if len(body) == size:
            return json.loads(body), fds
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    return None
