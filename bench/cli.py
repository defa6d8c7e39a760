"""Benchmark (not a test): how fast `sked status ID` answers, run the way an operator runs it.

Creates a throwaway database holding one task, then times `sked status ID` as a subprocess —
interpreter start, imports, one connection, one query, exit — `--calls` times: median and p90.
For scale it also times a bare interpreter start (`python -c pass`) on this machine.
Run: .venv/bin/python bench/cli.py [--calls 20] [--runs 1] [--bytecode]

--bytecode: the calls share a bytecode cache of their own (PYTHONPYCACHEPREFIX, in a temporary
directory, filled by one untimed call), as an installed sked has. Without it the environment is
taken as it is: with PYTHONDONTWRITEBYTECODE set, every call compiles sked's modules anew.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

from shared.models import TaskSpec
from shared.store import Store
from shared.store.migrate import migrate

ADMIN = os.environ.get("SKED_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
SKED = str(Path(sys.executable).with_name("sked"))
TASK = {"name": "bench-cli", "job": {"kind": "command", "argv": ["true"]}}


async def create(name: str) -> tuple[str, str]:
    """A migrated database holding one task: (its URL, the task's id)."""
    admin = await asyncpg.connect(ADMIN)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = ADMIN.rsplit("/", 1)[0] + "/" + name
    await migrate(dsn)
    store = await Store.connect(dsn, 1)
    try:
        task = await store.tasks.create(TaskSpec.parse(TASK))
    finally:
        await store.close()
    return dsn, str(task.id)


async def drop(name: str) -> None:
    admin = await asyncpg.connect(ADMIN)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def timed(argv: list[str], env: dict[str, str], calls: int, expect: str = "") -> list[float]:
    """Wall time of each of `calls` runs of argv, in ms; each must exit 0 (and print `expect`)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        times.append((time.perf_counter() - start) * 1000)
        if done.returncode != 0 or expect not in done.stdout:
            raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr or done.stdout}")
    return times


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def main(args: argparse.Namespace) -> None:
    name = f"sked_bench_cli_{os.getpid()}"
    dsn, task_id = asyncio.run(create(name))
    try:
        with tempfile.TemporaryDirectory(prefix="sked-bench-cli-") as cache:
            env = {**os.environ, "SKED_DATABASE_URL": dsn}
            for key in ("SKED_API_URL", "SKED_API_TOKEN"):  # straight to Postgres
                env.pop(key, None)
            if args.bytecode:
                env.pop("PYTHONDONTWRITEBYTECODE", None)
                env["PYTHONPYCACHEPREFIX"] = cache
            status = [SKED, "status", task_id]
            timed(status, env, 1, expect=task_id)  # warm the page cache (and the bytecode cache)
            medians = []
            for run in range(args.runs):
                ms = timed(status, env, args.calls, expect=task_id)
                medians.append(statistics.median(ms))
                print(
                    f"run {run + 1}: sked status, {args.calls} calls: median {medians[-1]:.0f} ms, "
                    f"p90 {pct(ms, 90):.0f} ms, min {min(ms):.0f} ms",
                    flush=True,
                )
            bare = timed([sys.executable, "-c", "pass"], env, args.calls)
            print(
                f"median of {args.runs}: {statistics.median(medians):.0f} ms "
                f"(bytecode cache: {'own' if args.bytecode else 'as the environment has it'}; "
                f"a bare `python -c pass` takes {statistics.median(bare):.0f} ms here)"
            )
    finally:
        asyncio.run(drop(name))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--bytecode", action="store_true", help="calls share a bytecode cache")
    main(parser.parse_args())
