"""The metrics port against clients that would hold it: found by an adversarial review, each
case failed before its fix."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from shared import metrics_port as metrics


def _scrape(port: int) -> bytes:
    """One GET /metrics, as Prometheus sends it: the response's bytes (b"" if refused)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return out


def test_slow_loris_clients_hold_every_metrics_slot_past_the_read_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The metrics port bounds each connection by READ_TIMEOUT_S *per read* only (the
    handler's socket timeout), never by a deadline for the whole request. A client that
    sends its request one byte every few seconds never trips a 10 s read timeout, so it holds
    its slot (one of MAX_CONNECTIONS = 16) for as long as it likes: wsgiref reads a request
    line of up to 64 KB and up to 100 header lines of 64 KB each. Sixteen such sockets from
    anyone who reaches the port (compose and Kubernetes bind 0.0.0.0) hold every slot, and
    every Prometheus scrape is closed unanswered: the target reads as down, the dashboards
    and sked's alert rules go blind, with no log line. The README promises "each read or
    write timed out after 10 s", which an operator reads as a bound on a slow client.

    Now each request must arrive whole within READ_TIMEOUT_S (here made 1 s) and
    MAX_REQUEST_BYTES, whatever the client does."""
    monkeypatch.setattr(metrics, "READ_TIMEOUT_S", 1.0)
    server = metrics.serve("127.0.0.1", 0)
    port = int(server.server_port)
    stop = threading.Event()
    socks: list[socket.socket] = []
    alive_after: list[bool] = []
    try:
        assert b"200 OK" in _scrape(port).split(b"\r\n", 1)[0]  # served while idle
        for _ in range(metrics.MAX_CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)

        def dribble() -> None:
            # a header byte per connection every 0.2 s: each read returns within its timeout
            while not stop.wait(0.2):
                for s in socks:
                    with contextlib.suppress(OSError):
                        s.sendall(b"X")

        t = threading.Thread(target=dribble, daemon=True)
        t.start()
        # well past READ_TIMEOUT_S: a bounded connection would have been cut by now
        time.sleep(metrics.READ_TIMEOUT_S * 1.5)
        answers = [_scrape(port) for _ in range(3)]
        # the slow clients are still connected (a send on a cut connection fails at last)
        for s in socks:
            try:
                s.sendall(b"X")
                s.setblocking(False)
                try:
                    alive_after.append(s.recv(1) != b"")
                except BlockingIOError:
                    alive_after.append(True)  # nothing to read, not closed: still held
            except OSError:
                alive_after.append(False)
        assert all(a.startswith(b"HTTP/1.0 200") for a in answers), (
            f"a scrape {metrics.READ_TIMEOUT_S * 1.5:.0f} s into a slow-loris of "
            f"{metrics.MAX_CONNECTIONS} connections got {[a[:40] for a in answers]!r}; "
            f"slow connections still held: {sum(alive_after)}/{len(alive_after)}"
        )
    finally:
        stop.set()
        for s in socks:
            s.close()
        server.shutdown()
        server.server_close()


def test_a_request_past_its_size_is_cut_without_an_answer() -> None:
    """wsgiref reads a request line of 64 KB and 100 header lines of 64 KB each: 6.5 MB a
    connection, held for as long as the client takes. A request is now cut past
    MAX_REQUEST_BYTES, and the next scrape is served."""
    server = metrics.serve("127.0.0.1", 0)
    port = int(server.server_port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n")
            header = b"X-Pad: " + b"a" * 1000 + b"\r\n"
            with contextlib.suppress(OSError):  # cut while sending: what is asked for
                for _ in range(2 * metrics.MAX_REQUEST_BYTES // len(header)):
                    s.sendall(header)
                s.sendall(b"\r\n")
            with contextlib.suppress(OSError):
                assert b" 200 " not in s.recv(65536)
        assert _scrape(port).startswith(b"HTTP/1.0 200")
    finally:
        server.shutdown()
        server.server_close()
