"""Benchmark (not a test): what one attempt's launch costs on the local backend, alone.

Runs `true` commands (and, with --handler, no-op handlers) through LocalBackend.run — the
warden's fork of a shim, the shim's fork and exec, the log file, the running record, the
outcome — with no scheduler, Postgres or RabbitMQ, `--concurrency` at a time, and prints the
attempts per second, the CPU one attempt costs (this process: what an executor spends; its
process tree: the warden, the shims, the handler workers and the programs), and where one
attempt's time goes:
  spawn   executor asks the warden -> the shim reports the program's pid (fork, fork, exec)
  run     pid reported -> the shim reports its exit (`true` itself, the shim's reaping)
  total   run() called -> returned (the rest: the log tail, the running record, files)
Run, from the checkout (bench is a package, not installed):
    .venv/bin/python -m bench.launch [--attempts 2000] [--concurrency 16] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from uuid import uuid4

from bench.profile import children, cpu_seconds
from services.executor.backends import Launch
from services.executor.backends.local import LocalBackend
from services.executor.backends.local import process as local_process
from shared.models import CommandJob, HandlerJob

PHASES = ("spawn", "run", "total")


class Clock:
    """Timestamps of one attempt's phases, taken by wrapping the backend's own seams."""

    def __init__(self) -> None:
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}

    def install(self) -> None:
        warden_spawn = local_process.Warden.spawn
        proc_wait = local_process.Proc.wait
        clock = self

        async def spawn(self: local_process.Warden, *args: object, **kw: object) -> object:
            t0 = time.perf_counter()
            proc = await warden_spawn(self, *args, **kw)  # type: ignore[arg-type]
            proc._bench_started = time.perf_counter()  # type: ignore[attr-defined]
            clock.phases["spawn"].append(proc._bench_started - t0)  # type: ignore[attr-defined]
            return proc

        async def wait(self: local_process.Proc) -> object:
            ended = await proc_wait(self)
            started = getattr(self, "_bench_started", None)
            if started is not None and not hasattr(self, "_bench_ended"):
                self._bench_ended = time.perf_counter()  # type: ignore[attr-defined]
                clock.phases["run"].append(self._bench_ended - started)  # type: ignore[attr-defined]
            return ended

        local_process.Warden.spawn = spawn  # type: ignore[method-assign,assignment]
        local_process.Proc.wait = wait  # type: ignore[method-assign,assignment]


async def attempts(
    backend: LocalBackend, job: CommandJob | HandlerJob, n: int, c: int, totals: list[float]
) -> float:
    work = iter(range(n))

    async def one_slot() -> None:
        for _ in work:
            t0 = time.perf_counter()
            outcome = await backend.run(Launch(uuid4(), 1, job, None, lease_s=60.0))
            totals.append(time.perf_counter() - t0)
            assert outcome.ok, outcome

    start = time.perf_counter()
    await asyncio.gather(*(one_slot() for _ in range(c)))
    return n / (time.perf_counter() - start)


def cpu_now() -> tuple[float, float]:
    """CPU seconds so far: this process's, and its descendants' (with what they reaped)."""
    return time.process_time(), sum(cpu_seconds(p) for p in children(os.getpid()))


async def main(args: argparse.Namespace) -> None:
    clock = Clock()
    clock.install()
    jobs: list[tuple[str, CommandJob | HandlerJob]] = [("true", CommandJob(argv=["true"]))]
    if args.handler:
        jobs.append(("no-op handler", HandlerJob(handler="bench.jobs:noop")))
    for name, job in jobs:
        rates, own_us, tree_us = [], [], []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="sked-launch-") as state:
                backend = LocalBackend(
                    args.concurrency,
                    Path(state),
                    warm_workers=args.concurrency,
                    env_pass=["PYTHONPATH"],
                )
                await backend.start()
                try:
                    total = clock.phases["total"]
                    await attempts(backend, job, min(200, args.attempts), args.concurrency, total)
                    for p in PHASES:
                        clock.phases[p].clear()
                    own, tree = cpu_now()
                    rates.append(
                        await attempts(backend, job, args.attempts, args.concurrency, total)
                    )
                    own_after, tree_after = cpu_now()
                    own_us.append((own_after - own) / args.attempts * 1e6)
                    tree_us.append((tree_after - tree) / args.attempts * 1e6)
                finally:
                    await backend.close()
        print(
            f"{name}: {statistics.median(rates):,.0f} attempts/s (median of {args.runs}, "
            f"{args.concurrency} at a time, the backend alone); CPU an attempt: "
            f"{statistics.median(own_us):,.0f} µs here (the executor's side), "
            f"{statistics.median(tree_us):,.0f} µs in its process tree"
        )
        for p, values in clock.phases.items():
            if values:
                values.sort()
                print(
                    f"  {p:6} p50 {values[len(values) // 2] * 1000:6.2f} ms   "
                    f"p90 {values[int(len(values) * 0.9)] * 1000:6.2f} ms"
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--attempts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--handler", action="store_true", help="no-op handlers as well")
    asyncio.run(main(parser.parse_args()))
