"""Handler functions the placement tests submit (imported by executors as
tests.e2e.placement_jobs:NAME).

Each attempt stamps its own start and end (epoch seconds, time.time()) into a file named after
its task under `dir`, one line each, so a test can tell from the tasks themselves what ran
where and when, including attempts that failed or were killed mid-run (those have no end line).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def _stamp(dir: str, what: str) -> float:
    at = time.time()
    task, attempt = os.environ["SKED_TASK_ID"], os.environ["SKED_ATTEMPT"]
    with (Path(dir) / task).open("a") as f:
        f.write(f"{what} {attempt} {at!r}\n")
    return at


def stamped(dir: str, ms: float = 0, fail_below: int = 0) -> dict[str, float]:
    """Sleep `ms` milliseconds between a start and an end stamp; raise on attempts numbered
    below `fail_below` (after the end stamp), so `fail_below=2` fails once, then succeeds."""
    start = _stamp(dir, "start")
    time.sleep(ms / 1000)
    end = _stamp(dir, "end")
    attempt = int(os.environ["SKED_ATTEMPT"])
    if attempt < fail_below:
        raise RuntimeError(f"attempt {attempt} asked to fail")
    return {"start": start, "end": end, "attempt": attempt}
