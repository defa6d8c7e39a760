"""Process trees from /proc: what the warden and its shims kill, freeze and thaw (stdlib only:
this runs in the warden and its shims, small forked processes)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from typing import NamedTuple

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36


# libc's prctl, looked up once in the warden: every shim and leader it forks inherits it
# (opening the library per call cost a launch about 0.1 ms, in pages copied after fork too).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def prctl(option: int, value: int) -> None:
    if _PRCTL is not None:
        _PRCTL(option, value, 0, 0, 0)


class Stat(NamedTuple):
    state: str  # R, S, D, T (stopped), Z (zombie), ...
    ppid: int
    pgid: int
    start_time: int  # ticks since boot: tells a process from a later one given the same pid


def stat(pid: int) -> Stat | None:
    """A process's line of /proc/<pid>/stat, or None if it is gone (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its last ")".
    fields = raw[raw.rindex(b")") + 2 :].split()
    return Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))


def start_time(pid: int) -> int | None:
    found = stat(pid)
    return None if found is None else found.start_time


def descendants(*roots: int) -> list[int]:
    """Every live process below each of `roots`, parents before children (one scan of
    /proc, whatever their number: a scan per root was quadratic in a tree of hundreds)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = stat(int(name))
            if found is not None and found.state not in ("Z", "X"):
                children.setdefault(found.ppid, []).append(int(name))
    out: list[int] = []
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_(pid: int, sig: int, *, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(pid, sig)


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def continue_stopped(warden: int) -> list[int]:
    """SIGCONT `warden` and its shims (its children and forks: the same command line) where
    stopped; returns those continued. sked never stops them (a lease freezes the tree below
    a shim), so a process of their user did; what a dead shim's tree left to the warden is
    not continued, but killed by the warden."""
    continued = []
    for pid in [warden, *descendants(warden)]:
        found = stat(pid)
        if found is None or found.state != "T":
            continue
        if pid == warden or (found.ppid == warden and _cmdline(pid) == _cmdline(warden)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                continued.append(pid)
    return continued
