"""The files an attempt shares with its task (its log, its inputs, its declared output), read
and removed as what the task may have made of them: the task runs as the executor's user, in
a directory it can find, and may have put a FIFO, a symlink or a directory in a file's place.
Nothing here blocks on such a thing, follows it, or raises for it where a task's doing must
not stop the executor."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)


class NotRegular(OSError):
    """The path holds something other than a regular file (or a symlink to anything)."""


@contextlib.contextmanager
def open_regular(path: Path | str) -> Iterator[BinaryIO]:
    """`path` opened for reading if it is a regular file: never following a symlink, never
    waiting on a FIFO's writer. Raises FileNotFoundError, NotRegular, or another OSError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegular(errno.EINVAL, "a symlink, not a regular file", str(path)) from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegular(errno.EINVAL, "not a regular file", str(path))
        yield f


def remove(path: Path | str) -> None:
    """Remove whatever is at `path`, a directory tree included; a failure is logged, never
    raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            log.warning("cannot remove the directory %s", path)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)


# A file made anew: never opened if anything is at its path (a FIFO, a symlink, a file the
# task made and keeps open), so that its open cannot block and its data go nowhere else.
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def create_new(path: Path | str, mode: int = 0o600) -> BinaryIO:
    """A regular file made anew at `path`, for writing, after removing whatever the task put
    there; readable by this user only unless `mode` says otherwise. Raises OSError
    (FileExistsError if what was there could not be removed, or came back meanwhile)."""
    remove(path)
    return os.fdopen(os.open(path, NEW_FILE, mode), "wb")


def write_new(path: Path | str, data: bytes) -> None:
    """`data` as the whole of a file made anew at `path` (create_new). Raises OSError."""
    with create_new(path) as f:
        f.write(data)


KEPT_BYTES = 16 * 1024 * 1024  # of an output that cannot be moved: its end, where errors are


def move_or_tail(src: Path | str, dst: Path | str, limit: int = KEPT_BYTES) -> None:
    """Move the file at `src` to `dst` (which must not hold a directory); where it cannot be
    moved (another file system), copy its last `limit` bytes instead. Never copies a whole
    file a task sized: one ftruncate()d to a terabyte of holes is free for the task, and
    would be a terabyte of real blocks copied. Raises OSError."""
    try:
        os.rename(src, dst)  # a hole stays a hole
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    with open_regular(src) as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(max(0, end - limit))
        # whatever the task put there: written anew, never through a symlink
        with create_new(dst) as out:
            while chunk := f.read(1 << 20):
                out.write(chunk)
