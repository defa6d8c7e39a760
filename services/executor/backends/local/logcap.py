"""A bound on what a running attempt writes to its log, so that one task printing without end
(`yes`, a loop logging each iteration) cannot fill the executor's disk, and with it every other
attempt's log and the node.

The attempt's stdout and stderr are its log file itself (no pipe and copy between them: that
would cost every attempt a hop), opened O_APPEND by its writers. So the bound is kept from
outside: every CHECK_S the executor looks at the files being written, and frees the head of one
over the limit in place (a hole punched in whole blocks, its last half kept), which moves
nothing its writers append after. Once the writers are gone (the attempt's end), a log over
the limit is rewritten as its last half behind a line saying how much went. The kubelet bounds
a container's log the same way (rotation at containerLogMaxSize); nothing here needs more than
a stat and, rarely, one system call, so no library is wanted. A cut lands mid-line: a log is
for reading; the outcome (exit code, $SKED_OUTPUT, the handler's result) is never cut.

The first version truncated a live log and wrote its last half back: what a writer appended
between the two went to the file's start, ahead of what it followed. A file system without
hole punching still gets that rewrite (the window narrowed to two back-to-back calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import stat
from collections.abc import Callable, Iterable

from shared.throttle import Throttled

log = logging.getLogger(__name__)
_said = Throttled(log)  # a task printing without end is cut four times a second

CHECK_S = 0.25  # how often: a writer at disk speed adds a few hundred MB in that time
# one cut of a file at a time (two interleaved kept its last half twice): the cut under way
_trimming: dict[str, asyncio.Future[int]] = {}


def trim(path: str, limit: int, *, compact: bool = False) -> int:
    """Cut the file at `path` to its last `limit` // 2 bytes, if it is a regular file over
    `limit` bytes: live, by punching out its head; `compact` (its writers are gone), rewritten
    behind a line naming what was dropped. The bytes dropped (0 if none). A task may put
    anything at a path it can reach: a symlink is not followed, a FIFO not read."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0  # gone (the attempt ended), or not a file a writer of ours made
    try:
        info = os.fstat(fd)
        size = info.st_size if compact else _stored(info)
        if not stat.S_ISREG(info.st_mode) or size <= limit:
            return 0
        start = max(info.st_size - limit // 2, 0)
        if not compact:
            block = max(info.st_blksize, 512)
            if _punch(fd, start // block * block):
                return max(_stored(info) - _stored(os.fstat(fd)), 0)
        kept = _data(fd, start, info.st_size)
        dropped = info.st_size - len(kept)
        note = f"[sked: {dropped} bytes of earlier output dropped: SKED_LOG_MAX_BYTES is {limit}]\n"
        payload = note.encode() + kept  # before the truncation: nothing between it and the write
        os.ftruncate(fd, 0)
        os.write(fd, payload)
        return dropped
    finally:
        os.close(fd)


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = getattr(_libc, "fallocate64", None) or getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _fallocate.restype = ctypes.c_int


def _punch(fd: int, end: int) -> bool:
    """The file's first `end` bytes freed in place (read back as a hole), its size and every
    offset after them unchanged; False where the file system cannot (then it is rewritten).
    Through libc: Python's os module has posix_fallocate, without fallocate's modes."""
    if end <= 0 or _fallocate is None:  # (a limit under two blocks: nothing whole to free)
        return False
    done: int = _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, end)
    return done == 0


def _data(fd: int, start: int, end: int) -> bytes:
    """The bytes written between `start` and `end`, holes left out. A writer without O_APPEND
    (`> /dev/stdout` in dash, `tee /dev/stderr`) writes on at its own offset past a cut, and
    leaves a hole where the cut output was, which reads as zeros: kept, they were written back
    as real NUL bytes. (The zeros of a block a hole ends in go too: no task writes them.)"""
    parts: list[bytes] = []
    at = start
    while at < end:
        try:
            at = os.lseek(fd, at, os.SEEK_DATA)
        except OSError:  # ENXIO: nothing written after it
            break
        if at >= end:
            break
        hole = min(os.lseek(fd, at, os.SEEK_HOLE), end)
        part = os.pread(fd, hole - at, at)
        parts.append(part.lstrip(b"\0") if parts or at > start else part)
        at = hole
    return b"".join(parts)


def _stored(info: os.stat_result) -> int:
    """The bytes a file takes on disk: a hole a writer without O_APPEND leaves past a cut
    (its offset runs on) takes none, and its size, which counts it, is not what is bounded."""
    return min(info.st_size, info.st_blocks * 512)


def _over(paths: Iterable[str], limit: int, compact: bool = False) -> list[str]:
    over = []
    for path in paths:
        with contextlib.suppress(OSError):
            info = os.stat(path, follow_symlinks=False)
            if (info.st_size if compact else _stored(info)) > limit:
                over.append(path)
    return over


async def bound(path: str, limit: int, *, compact: bool = False) -> None:
    """`path` trimmed (in a thread) if it is over `limit` bytes; `compact` (its writers are
    gone): if its size is, holes counted, so that a hole a writer left is not kept."""
    if not compact and path in _trimming:
        return
    # The last cut, once the writers are gone, waits for those under way: every one, not only
    # this path's, since a handler's output is cut live by its worker's out file's path and
    # compacted by its log's, the same file renamed (a punch computed on the live file, landing
    # on the rewritten one, would make a hole of it all). Rarely any is.
    for under_way in list(_trimming.values()) if compact else ():
        with contextlib.suppress(Exception):  # (its own failure is its caller's)
            await asyncio.shield(under_way)
    if not _over([path], limit, compact):
        return
    cut = _trimming[path] = asyncio.ensure_future(
        asyncio.to_thread(trim, path, limit, compact=compact)
    )
    # registered until the thread is done, not until this call is: a cancelled caller (the
    # attempt's stop) leaves the thread cutting, and the next cut must still wait for it
    cut.add_done_callback(functools.partial(_cut_done, path))
    dropped = await asyncio.shield(cut)
    if dropped:
        _said.warning("log %s over %d bytes: %d bytes of it dropped", path, limit, dropped)


def _cut_done(path: str, cut: asyncio.Future[int]) -> None:
    if _trimming.get(path) is cut:
        del _trimming[path]
    if not cut.cancelled():
        cut.exception()  # its caller has it, if still waiting; else the next look tries again


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
