"""A bound on what a running attempt writes to its log, so that one task printing without end
(`yes`, a loop logging each iteration) cannot fill the executor's disk, and with it every other
attempt's log and the node.

The attempt's stdout and stderr are its log file itself (no pipe and copy between them: that
would cost every attempt a hop), opened O_APPEND by its writers. So the bound is kept from
outside: every CHECK_S the executor looks at the files being written, and one over the limit is
cut to its last half, behind a line saying how much went. The kubelet bounds a container's log
the same way (rotation at containerLogMaxSize); nothing here needs more than a stat and, rarely,
one read and one write, so no library is wanted. What a writer adds in the instant between the
read and the truncation is lost, and the cut lands mid-line: a log is for reading, the
outcome (exit code, $SKED_OUTPUT, the handler's result) is never cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterable

from shared.throttle import Throttled

log = logging.getLogger(__name__)
_said = Throttled(log)  # a task printing without end is cut four times a second

CHECK_S = 0.25  # how often: a writer at disk speed adds a few hundred MB in that time
MIN_LOG_BYTES = 64 * 1024


def trim(path: str, limit: int) -> int:
    """Cut the file at `path` to its last `limit` // 2 bytes, behind a line naming what was
    dropped, if it is a regular file over `limit` bytes; the bytes dropped (0 if none). A
    task may put anything at a path it can reach: a symlink is not followed, a FIFO not read."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0  # gone (the attempt ended), or not a file a writer of ours made
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size <= limit:
            return 0
        keep = limit // 2
        kept = os.pread(fd, keep, info.st_size - keep)
        os.ftruncate(fd, 0)
        dropped = info.st_size - len(kept)
        note = f"[sked: {dropped} bytes of earlier output dropped: SKED_LOG_MAX_BYTES is {limit}]\n"
        os.write(fd, note.encode() + kept)
        return dropped
    finally:
        os.close(fd)


def _over(paths: Iterable[str], limit: int) -> list[str]:
    over = []
    for path in paths:
        with contextlib.suppress(OSError):
            if os.stat(path, follow_symlinks=False).st_size > limit:
                over.append(path)
    return over


async def bound(path: str, limit: int) -> None:
    """`path` trimmed (in a thread) if it is over `limit` bytes."""
    if _over([path], limit) and (dropped := await asyncio.to_thread(trim, path, limit)):
        _said.warning("log %s over %d bytes: %d bytes of it dropped", path, limit, dropped)


async def keep_bounded(paths: Callable[[], Iterable[str]], limit: int) -> None:
    """Forever: every CHECK_S, each of `paths()` over `limit` bytes trimmed."""
    while True:
        await asyncio.sleep(CHECK_S)
        try:
            written = paths()
        except OSError as exc:  # a task may remove a directory it can reach: not the node's end
            _said.warning("the logs' bound not kept this time: %s", exc)
            continue
        for path in _over(written, limit):
            await bound(path, limit)
