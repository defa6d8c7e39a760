"""A handler worker's reply pipe as the executor reads it (workers.Replies): whole lines however
the pipe splits them, none when the worker died mid-line or wrote past the limit, and a wait
that ends on a line, the end of the pipe, another future or its timeout. Real pipes. And the
worker's failure reply, which fits that limit whatever the exception's text holds."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from services.executor.backends.local import worker
from services.executor.backends.local.replies import Replies
from services.executor.backends.local.worker import MAX_REPLY_BYTES


@pytest.fixture
async def pipe() -> AsyncIterator[tuple[Replies, int]]:
    """Replies reading a pipe, and the pipe's write end."""
    read, write = os.pipe()
    replies = Replies()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: replies, os.fdopen(read, "rb", 0)
    )
    yield replies, write
    transport.close()
    if not replies.ended:
        os.close(write)


async def test_a_line_split_across_writes_is_one_reply(pipe: tuple[Replies, int]) -> None:
    replies, write = pipe
    os.write(write, b'{"ok": tr')
    await asyncio.sleep(0.05)
    assert not replies.answered()
    assert replies.take() is None
    os.write(write, b'ue}\n{"ok": false}\n')
    await replies.wait(timeout=5)
    assert replies.take() == b'{"ok": true}\n'
    assert replies.take() == b'{"ok": false}\n'
    assert replies.take() is None


async def test_a_wait_ends_with_the_line(pipe: tuple[Replies, int]) -> None:
    replies, write = pipe
    waiting = asyncio.create_task(replies.wait(timeout=5))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    os.write(write, b"reply\n")
    await asyncio.wait_for(waiting, 5)
    assert replies.take() == b"reply\n"


async def test_a_worker_gone_mid_line_leaves_no_reply(pipe: tuple[Replies, int]) -> None:
    replies, write = pipe
    os.write(write, b'{"ok": tr')
    os.close(write)
    await replies.wait(timeout=5)
    assert replies.answered()
    assert replies.ended
    assert replies.take() is None


async def test_a_line_past_the_limit_breaks_the_pipe(pipe: tuple[Replies, int]) -> None:
    replies, write = pipe
    os.set_blocking(write, False)  # a full pipe must not block the loop that drains it
    chunk = b"x" * 65536
    written = 0
    while not replies.broken and written <= MAX_REPLY_BYTES + 2 * len(chunk):
        try:
            written += os.write(write, chunk)
        except BlockingIOError:
            await asyncio.sleep(0.001)
    await replies.wait(timeout=5)
    assert replies.broken
    assert replies.answered()
    os.write(write, b"\n")  # the rest of the line that broke it is no reply either
    await asyncio.sleep(0.05)
    assert replies.take() is None


async def test_a_wait_ends_with_another_future_or_its_timeout(pipe: tuple[Replies, int]) -> None:
    replies, _ = pipe
    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(replies.wait(stop, timeout=None))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    stop.set_result(None)
    await asyncio.wait_for(waiting, 5)
    await asyncio.wait_for(replies.wait(timeout=0.01), 5)  # nothing came: the timeout ends it
    assert not replies.answered()


@pytest.mark.parametrize("char", ["\x01", "\U0001f600", "\udc80", "\\"])
def test_a_failure_reply_fits_its_line_whatever_the_exception_holds(char: str) -> None:
    """A traceback is cut by characters; escaped, each is at most 12 bytes of JSON: an
    exception's text of 3 M control characters (18 MB escaped) once made the reply a line
    past the limit, taken for a protocol breach."""
    try:
        raise ValueError(char * (MAX_REPLY_BYTES // 2))
    except ValueError as exc:
        reply = worker._failure(worker.describe(exc))
    assert len(reply) < MAX_REPLY_BYTES
    assert reply.endswith(b"\n")
    assert reply.count(b"\n") == 1
