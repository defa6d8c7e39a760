"""A handler worker's reply pipe, read as lines (one reply each) without a task per job."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from services.executor.backends.local.worker import MAX_REPLY_BYTES


class Replies(asyncio.Protocol):
    """A worker's reply pipe: its lines, waited for (the worker's ready line) or, once
    `on_change` is set, handed to the worker's bookkeeping as they come.

    Not an asyncio.StreamReader: its readline wants a task of its own per job, and
    asyncio.wait around that task, the worker's death and a stop — together about a tenth
    of the executor's side of a no-op handler's round trip (docs/performance.md)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._lines: deque[bytes] = deque()
        self.ended = False  # end of file: the worker died, or closed its end
        self.broken = False  # a line longer than MAX_REPLY_BYTES: no reply can be trusted
        self._waiter: asyncio.Future[None] | None = None
        # Once set (a worker that serves jobs), called whenever lines arrived or the pipe
        # ended or broke, instead of waking a waiter.
        self.on_change: Callable[[], None] | None = None

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        end = data.find(b"\n")
        buffer += data
        if end >= 0:
            end += len(buffer) - len(data)
            while end >= 0:
                self._lines.append(bytes(buffer[: end + 1]))
                del buffer[: end + 1]
                end = buffer.find(b"\n")
            self._wake()
        if len(buffer) > MAX_REPLY_BYTES + 1024:
            self.broken = True
            buffer.clear()
            self._wake()

    def eof_received(self) -> None:
        self.ended = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._wake()

    def _wake(self, _: object = None) -> None:
        if self.on_change is not None:
            self.on_change()
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def answered(self) -> bool:
        """A line is in, or none will come."""
        return bool(self._lines) or self.ended or self.broken

    def take(self) -> bytes | None:
        """The next whole line; None if there is none (and, with `answered()`, none will be)."""
        if self.broken or not self._lines:
            return None
        return self._lines.popleft()

    async def wait(self, *also: asyncio.Future[Any], timeout: float | None) -> None:
        """Until `answered()`, one of `also` is done, or `timeout` seconds pass."""
        if self.answered() or any(f.done() for f in also):
            return
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        for future in also:
            future.add_done_callback(self._wake)
        timer = None if timeout is None else loop.call_later(timeout, self._wake)
        try:
            await self._waiter
        finally:
            self._waiter = None
            for future in also:
                future.remove_done_callback(self._wake)
            if timer is not None:
                timer.cancel()
