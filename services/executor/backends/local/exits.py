"""How an attempt's process tree ended, as the shim reports it, and in words."""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class Exit:
    """How a process tree ended: `code` as asyncio gives it (>= 0 exit code, < 0 the signal
    that killed it, None if unknown) and `how`: exited, stopped, killed, frozen too long,
    orphaned, terminated, or lost (the shim vanished without a word)."""

    code: int | None
    how: str


def exit_text(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"
