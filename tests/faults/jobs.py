"""What fault-injection tasks run: each attempt stamps its own start and end in a file, so the
tests can tell from the tasks' own output whether two attempts of a task ever overlapped."""

from __future__ import annotations

import os
import time
from pathlib import Path


def stamp(dir: str, ms: float = 0) -> int:
    """Append `<attempt> start <t>` and, after `ms` milliseconds, `<attempt> end <t>`."""
    path = Path(dir) / os.environ["SKED_TASK_ID"]
    attempt = os.environ["SKED_ATTEMPT"]
    with path.open("a") as f:
        f.write(f"{attempt} start {time.time():.6f}\n")
    time.sleep(ms / 1000)
    with path.open("a") as f:
        f.write(f"{attempt} end {time.time():.6f}\n")
    return int(attempt)


def shell_stamp(path: Path, seconds: float) -> list[str]:
    """The same for a command task: `sh -c` that stamps, sleeps, stamps."""
    script = (
        f'echo "$SKED_ATTEMPT start $(date +%s.%N)" >> {path}/$SKED_TASK_ID; '
        f'sleep {seconds}; echo "$SKED_ATTEMPT end $(date +%s.%N)" >> {path}/$SKED_TASK_ID'
    )
    return ["sh", "-c", script]
