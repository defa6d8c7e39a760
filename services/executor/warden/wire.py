"""The warden's framing: a spawn request is a 4-byte length, then that much JSON, with the
attempt's file descriptors attached to its first byte. The executor sends them to the warden,
and the warden hands them on to an idle shim as they came, unread: only the shim that runs
the attempt decodes the request."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from typing import Any

HEADER = struct.Struct("!I")
MAX_FDS = 4


def frame(request: bytes) -> bytes:
    """A request's JSON as sent: its length first."""
    return HEADER.pack(len(request)) + request


def send(sock: socket.socket, request: bytes, fds: list[int]) -> None:
    """A request with `fds` attached (a blocking socket; requests are small)."""
    socket.send_fds(sock, [frame(request)], fds)


def decode(request: bytes) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(request)
    return value


def receive(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """One request's JSON, still encoded, and its descriptors; None when the other end closed
    (or sent a truncated frame: it died mid-send)."""
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
            return body, fds
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    return None
