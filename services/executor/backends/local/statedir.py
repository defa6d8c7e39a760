"""The state directory kept to the executor's user: its directories made (or made again) 0700
and refused if another user owns one, or could swap one for their own, or if one is a symlink;
and an attempt's inputs written to a file of its own, 0600. The default state dir,
<tmp>/sked/<node id>, has a path every user of the host can predict and create first."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from services.executor.backends.local.files import write_new

PRIVATE = 0o700


class UnsafeStateDir(RuntimeError):
    """The state dir, or a directory above it, is not this user's alone to use."""


def make_private(root: Path, subdirs: Iterable[Path]) -> None:
    """Make `root` and its `subdirs` (directly below it) directories of this user, mode 0700:
    created so, or, if there already, checked and set so. Raises UnsafeStateDir naming the
    path for a symlink, something other than a directory, a directory of another user, or a
    directory above `root` where another user could replace it."""
    root.parent.mkdir(parents=True, exist_ok=True)  # its parents: the umask's mode, like mkdir -p
    for above in (root.parent, *root.parent.parents):
        _check_above(above)
    for path in (root, *subdirs):
        _make_private(path)


def _refuse(path: Path, why: str) -> UnsafeStateDir:
    return UnsafeStateDir(
        f"unsafe state directory {path}: {why}; the executor will not use it "
        "(remove it, or set SKED_STATE_DIR to a directory of this user's own)"
    )


def _check_above(path: Path) -> None:
    """A directory above the state dir: anyone who can rename entries in it (its owner, or
    anyone who may write to it unless it is sticky) could put a directory of their own in the
    state dir's place. It must be root's or this user's, writable by no one else (or sticky)."""
    st = os.stat(path)  # a symlink above is the operator's (/var/run -> /run): its target counts
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise _refuse(path, f"a directory above it is owned by uid {st.st_uid}, not by uid {me}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        mode = oct(stat.S_IMODE(st.st_mode))
        raise _refuse(path, f"a directory above it may be written by other users ({mode})")


def _make_private(path: Path) -> None:
    with contextlib.suppress(FileExistsError):  # then checked as what anyone may have made
        os.mkdir(path, PRIVATE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "it is a symlink (give its real path)") from None
        if exc.errno == errno.ENOTDIR:
            raise _refuse(path, "it is not a directory") from None
        raise
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid != me:
            raise _refuse(path, f"it is owned by uid {st.st_uid}, not by this user (uid {me})")
        if stat.S_IMODE(st.st_mode) != PRIVATE:
            os.fchmod(fd, PRIVATE)  # the directory opened, not whatever its path names now
    finally:
        os.close(fd)


async def write_inputs(path: Path, inputs: object) -> None:
    """An attempt's inputs, as JSON, to a file made anew at `path` (whatever a task put there
    removed first), 0600. Off the event loop: inputs run to megabytes."""
    await asyncio.to_thread(_write_inputs, path, inputs)


def _write_inputs(path: Path, inputs: object) -> None:
    write_new(path, json.dumps(inputs).encode())


def take_lock(state_dir: Path) -> int:
    """The state directory's lock, held while the executor runs: two backends on one state_dir
    would reap each other's live attempts."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(state_dir / "lock", flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"{state_dir} is in use by another executor") from None
    return fd
