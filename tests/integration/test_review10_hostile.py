"""A review of 995d1fe (review 10, the sixteenth session's last): the case failed then (its
docstring says what happened, and what happens now). Held up: Starter.settle's taken-by-lease
path (pause then resume to Scheduling attempt 2 on the same node, lease held or lapsed,
before the retried claim's read; cancel with the lease released; two copies of one attempt),
and a plain PROBE_X=1 appended below os.environ.

Handlers run in the workers as `tests.integration.test_review10_hostile:<name>`."""

from __future__ import annotations

import ctypes
import os
import subprocess
from typing import Any
from uuid import uuid4

import pytest

from services.executor.backends import Launch
from services.executor.backends.local import LocalBackend
from shared.models import HandlerJob
from tests.integration.test_worker_state_hostile import one, run  # noqa: F401

HERE = "tests.integration.test_review10_hostile"


def h(name: str, args: Any = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}", args=args), None)


def child_env() -> dict[str, Any]:
    out = subprocess.run(["env", "-0"], capture_output=True, check=True).stdout
    return {
        "entries": sorted(e.decode() for e in out.split(b"\0") if e and not e.startswith(b"SKED_")),
        "pid": os.getpid(),
    }


def append_raw(text: str) -> int:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    env = ctypes.c_void_p.in_dll(libc, "environ")
    slots = ctypes.cast(env.value, ctypes.POINTER(ctypes.c_void_p))
    n = 0
    while slots[n]:
        n += 1
    new = libc.malloc(ctypes.c_size_t(8 * (n + 2)))
    arr = ctypes.cast(new, ctypes.POINTER(ctypes.c_void_p))
    for i in range(n):
        arr[i] = slots[i]
    raw = text.encode() + b"\0"
    buf = libc.malloc(ctypes.c_size_t(len(raw)))
    ctypes.memmove(buf, raw, len(raw))
    arr[n] = buf
    arr[n + 1] = None
    env.value = new
    return os.getpid()


@pytest.mark.parametrize("entry", ["=evil", "HOME"])
async def test_an_entry_no_name_can_unset_reaches_no_later_job(
    one: LocalBackend, entry: str
) -> None:
    """A job appends to the C environment an entry with an empty name ("=evil") or with no
    '=' at all (a bare "HOME" beside HOME=/root), as a C extension building its own array
    may. The worker sees the array moved, but `_c_environ` splits each entry at its first
    '=': "=evil" becomes name b"" (os.unsetenv(b"") raises ValueError, suppressed) and bare
    "HOME" becomes HOME=b"" (marked a duplicate; glibc's unsetenv removes only "HOME=..."
    entries, so the bare one stays). Nothing removes them: every later job's subprocess
    (env=None) inherits the entry (`env -0` shows it). Now `_c_environ` marks such an entry,
    and a C environment holding one is emptied (clearenv) and built again from os.environ."""
    before = await run(one, h("child_env"))
    o = await run(one, h("append_raw", [entry]))
    assert o.ok, o.error
    after = await run(one, h("child_env"))
    assert after.result["pid"] == before.result["pid"] == o.result
    assert after.result["entries"] == before.result["entries"], set(after.result["entries"]) ^ set(
        before.result["entries"]
    )
