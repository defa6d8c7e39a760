"""Reading the tasks' own stamps: did any attempt start twice, did two attempts overlap?"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from uuid import UUID


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


def task_processes() -> dict[str, dict[int, list[str]]]:
    """{task id: {attempt: [/proc state of each of its processes]}} of every process that
    carries SKED_TASK_ID in its environment."""
    out: dict[str, dict[int, list[str]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            raw = (entry / "stat").read_bytes()
        except OSError:
            continue
        task = next((v[13:].decode() for v in environ if v.startswith(b"SKED_TASK_ID=")), None)
        if task is None:
            continue
        attempt = next(
            (int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"SKED_ATTEMPT=")), 0
        )
        state = raw[raw.rindex(b")") + 2 :].split()[0].decode()
        out.setdefault(task, {}).setdefault(attempt, []).append(state)
    return out


@dataclass
class Sampler:
    """Samples the processes of every task (or of `task_id` only) every 0.2 s until stopped:
    by task, the seconds in which two of its attempts had a running (not stopped) process,
    the attempts seen frozen (every process stopped), and the attempts seen at all."""

    task_id: UUID | None = None
    samples: int = 0
    both: dict[str, float] = field(default_factory=dict)
    frozen: dict[str, set[int]] = field(default_factory=dict)
    seen: dict[str, set[int]] = field(default_factory=dict)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            procs = await asyncio.to_thread(task_processes)
            if self.task_id is not None:
                procs = {k: v for k, v in procs.items() if k == str(self.task_id)}
            for task, attempts in procs.items():
                running = {a for a, st in attempts.items() if set(st) - {"T", "t", "Z", "X"}}
                stopped = {a for a, st in attempts.items() if set(st) <= {"T", "t"}}
                self.frozen.setdefault(task, set()).update(stopped)
                self.seen.setdefault(task, set()).update(attempts)
                if len(running) > 1:
                    self.both[task] = self.both.get(task, 0.0) + 0.2
            self.samples += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


@contextlib.asynccontextmanager
async def sampling(task_id: UUID | None = None) -> AsyncIterator[Sampler]:
    sampler, stop = Sampler(task_id), asyncio.Event()
    job = asyncio.create_task(sampler.run(stop))
    try:
        yield sampler
    finally:
        stop.set()
        await job
