"""A TCP proxy the test controls, to cut one process off from a server (a network partition).

`cut()` is a silent partition: bytes stop flowing both ways, connections stay open and new
ones are accepted but go nowhere — no reset, no refusal, as when packets are dropped. `heal()`
resets what the cut held (clients see their connections drop, and reconnect) and forwards
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cut_off = False
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._resume = asyncio.Event()
        self._resume.set()

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        sock: socket.socket = self._server.sockets[0]
        self.port = sock.getsockname()[1]
        return self

    def url(self, url: str) -> str:
        """`url` with its 127.0.0.1:<target> replaced by this proxy."""
        return url.replace(f"127.0.0.1:{self.target_port}", f"127.0.0.1:{self.port}")

    def cut(self) -> None:
        self.cut_off = True
        self._resume.clear()

    def heal(self) -> None:
        for writer in list(self._conns):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._conns.clear()
        self.cut_off = False
        self._resume.set()

    async def close(self) -> None:
        self.heal()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            await self._resume.wait()  # a connection made during a cut hangs, unanswered
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._conns.add(up_writer)
        token = self._opened()
        await asyncio.gather(
            self._pump(reader, up_writer, token),
            self._pump(up_reader, writer, token),
            return_exceptions=True,
        )
        for w in (writer, up_writer):
            self._conns.discard(w)
            w.transport.abort()

    def _opened(self) -> object:
        """What a subclass notes of each connection as it opens, given to its two pumps."""
        return None

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, _token: object = None
    ) -> None:
        while data := await src.read(65536):
            if self.cut_off:
                await self._resume.wait()  # hold it: lost in the partition
                return  # healing resets the connection: what was held is gone
            dst.write(data)
            await dst.drain()
