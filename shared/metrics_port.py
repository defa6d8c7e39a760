"""The metrics port: prometheus_client's WSGI app served from a thread of its own, within
bounds that anyone who reaches the port (containers bind 0.0.0.0) cannot outlast.

Written here rather than taken from prometheus_client.start_http_server: that server starts
a thread per connection without a bound and reads each without a deadline."""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, make_wsgi_app

log = logging.getLogger(__name__)

# The bounds: a thread per connection, at most MAX_CONNECTIONS of them (past it a connection is
# closed at once). Unbounded, anyone who reached the port held a thread per idle connection for
# ever, until the process could start none (asyncio's executor, getaddrinfo). Each request must
# arrive whole within READ_TIMEOUT_S and MAX_REQUEST_BYTES: a timeout per read alone let a
# client sending a byte every few seconds keep its slot for days, and sixteen such held every
# slot while each scrape was closed unanswered. A scrape's request is well under 1 KB.
MAX_CONNECTIONS = 16
READ_TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 16 * 1024


class _Bounded(io.RawIOBase):
    """A connection's bytes, every receive within the request's one deadline and size: a
    deadline checked per readline would wait as long as a header line takes to dribble in."""

    def __init__(self, connection: socket.socket) -> None:
        self._connection = connection
        self._deadline = time.monotonic() + READ_TIMEOUT_S
        self._left = MAX_REQUEST_BYTES

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0 or self._left <= 0:
            raise TimeoutError("the request did not arrive within its bounds")
        self._connection.settimeout(remaining)
        n = self._connection.recv_into(buffer, min(len(buffer), self._left))
        self._left -= n
        return n


class _Handler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # StreamRequestHandler sets it on the connection

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the connection's own reader: replaced by a bounded one
        self.rfile = io.BufferedReader(_Bounded(self.connection))

    def log_message(self, format: str, *args: Any) -> None:
        """A line per scrape is noise."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape never holds the process's exit
    request_queue_size = 64  # the listen backlog: 5 made a burst of connections wait 1 s each

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kw)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: refused, and no thread started
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that went quiet (timed out), too big, or away: not worth a traceback
        log.debug("metrics request from %s failed", client_address, exc_info=True)


def serve(host: str, port: int) -> WSGIServer:
    """Serve the registry on GET /metrics at host:port from a thread of its own, within the
    bounds above (a scrape is answered even while the event loop is busy)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server_class = type("_MetricsServer", (_Server,), {"address_family": family})
    app = make_wsgi_app(REGISTRY)
    server: WSGIServer = make_server(str(sockaddr[0]), port, app, server_class, _Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
