"""What execve() takes (Linux), judged without running anything: a command whose argument or
environment is over it can never start (E2BIG). Checked when a command is submitted
(shared.models.CommandJob) and again when the Kubernetes backend adds a task's inputs to its
Job's environment."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Each argv or env string at most MAX_ARG_STRLEN bytes with its NUL, and all of them (strings,
# NULs and pointers) within ARG_MAX, a quarter of the stack limit (2 MiB under the default
# 8 MiB).
MAX_ARG_STRLEN = 32 * 4096
ARG_MAX = 2 * 2**20
_POINTER = 8
# room for what the runner adds: sked's own variables, an image's ENV, the kubelet's
_EXEC_MARGIN = 64 * 2**10


def check_exec_size(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Raise ValueError, naming the size and the limit, when a command or its environment is
    more than execve() takes: it would fail to start every time ("argument list too long");
    and, naming it, for an environment variable's name no process can get (empty, or with "=").
    Counted in bytes as the process gets them; what the runner adds comes on top, so the total
    is kept below ARG_MAX by a margin."""
    for name in env:
        if not name or "=" in name:
            # execve() splits each string at its first "=": no process can get this name
            raise ValueError(f"environment variable name {name!r} is not one a process can get")
    total = 0
    for what, text in [("argument", a) for a in argv] + [
        (f"environment variable {k}", f"{k}={v}") for k, v in env.items()
    ]:
        size = len(text.encode("utf-8", "surrogatepass")) + 1
        if size > MAX_ARG_STRLEN:
            raise ValueError(
                f"{what} is {size - 1} bytes: over the {MAX_ARG_STRLEN - 1} a single argument "
                "or environment string may have (Linux MAX_ARG_STRLEN), so the command "
                "could never start"
            )
        total += size + _POINTER
    if total > ARG_MAX - _EXEC_MARGIN:
        raise ValueError(
            f"the command and environment are {total} bytes: over the {ARG_MAX - _EXEC_MARGIN} "
            f"a command's exec may take here (ARG_MAX {ARG_MAX}, less room for the image's "
            "environment), so the command could never start"
        )
