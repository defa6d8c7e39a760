"""Reading the tasks' own stamps: did any attempt start twice, did two attempts overlap?"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Run:
    attempt: int
    start: float
    end: float | None  # None: the process died before it could stamp its end


def read_stamps(d: Path) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for path in d.iterdir():
        runs: list[Run] = []
        for line in path.read_text().splitlines():
            attempt, what, at = line.split()
            if what == "start":
                runs.append(Run(int(attempt), float(at), None))
            else:
                open_runs = [r for r in runs if r.attempt == int(attempt) and r.end is None]
                assert open_runs, f"{path.name}: an end without a start: {line}"
                open_runs[-1].end = float(at)
        out[path.name] = runs
    return out


def duplicated(stamps: dict[str, list[Run]], killed_at: float | None = None) -> int:
    """How many tasks had an attempt start twice, or two attempts running at once.

    A run with no end died with its executor at `killed_at` (when given); it counts as
    running until then, so an attempt that started before the kill was over overlaps.
    """
    bad = 0
    for runs in stamps.values():
        starts = Counter(r.attempt for r in runs)
        twice = any(n > 1 for n in starts.values())
        ordered = sorted(runs, key=lambda r: r.start)
        overlap = False
        for a, b in itertools.pairwise(ordered):
            end = a.end if a.end is not None else killed_at
            if end is None or b.start < end:
                overlap = True
        bad += twice or overlap
    return bad


def overlap_s(stamps: dict[str, list[Run]], killed_at: float | None = None) -> float:
    """Seconds, summed over tasks, during which two attempts of one task ran at once (from the
    tasks' own stamps; a run with no end ran until `killed_at`)."""
    total = 0.0
    for runs in stamps.values():
        ordered = sorted(runs, key=lambda r: r.start)
        for a, b in itertools.pairwise(ordered):
            end = a.end if a.end is not None else killed_at
            if end is not None and b.start < end:
                total += end - b.start
    return total


def started_twice(stamps: dict[str, list[Run]]) -> int:
    """How many tasks had one attempt start twice (whether two attempts overlapped is for a
    sampler of /proc to tell, when an attempt was frozen and killed before its end stamp)."""
    return sum(
        any(n > 1 for n in Counter(r.attempt for r in runs).values()) for runs in stamps.values()
    )
