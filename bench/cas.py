"""Benchmark (not a test): single and batched CAS transitions per second on the local Postgres.

Each transition is the full production statement: CAS + event row + pg_notify.
Run: .venv/bin/python bench/cas.py [--runs 3] [--single 3000] [--batched 30000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import asyncpg

from shared import fsm
from shared.fsm import State
from shared.models import TaskSpec
from shared.store import Store
from shared.store.db import create_pool
from shared.store.migrate import migrate

ADMIN = os.environ.get("SKED_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
SPEC = TaskSpec.parse({"name": "bench", "job": {"kind": "handler", "handler": "m:f"}})


async def single(store: Store, n: int, concurrency: int) -> float:
    tasks = await store.tasks.create_many([SPEC] * n)
    work = iter(tasks)

    async def worker() -> None:
        for task in work:
            await fsm.apply(store.tasks, task, State.PENDING)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - start)


async def batched(store: Store, n: int, size: int, concurrency: int) -> float:
    tasks = []
    for i in range(0, n, 1000):
        tasks.extend(await store.tasks.create_many([SPEC] * min(1000, n - i)))
    chunks = iter([tasks[i : i + size] for i in range(0, n, size)])

    async def worker() -> None:
        for chunk in chunks:
            moved = await store.tasks.transition_many([fsm.plan(t, State.PENDING) for t in chunk])
            assert len(moved) == len(chunk)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - start)


async def main(args: argparse.Namespace) -> None:
    name = f"sked_bench_{os.getpid()}"
    admin = await asyncpg.connect(ADMIN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    dsn = ADMIN.rsplit("/", 1)[0] + "/" + name
    try:
        await migrate(dsn)
        pool = await create_pool(dsn, size=12)
        store = Store(pool, dsn)
        singles, batches = [], []
        for run in range(args.runs):
            singles.append(await single(store, args.single, 12))
            batches.append(await batched(store, args.batched, args.batch_size, 4))
            print(f"run {run + 1}: single {singles[-1]:,.0f}/s  batched {batches[-1]:,.0f}/s")
        await pool.close()
        print(
            f"median of {args.runs}: single CAS+event+notify {statistics.median(singles):,.0f}"
            f" transitions/s (12 in flight); batched ({args.batch_size}/statement, 4 in flight)"
            f" {statistics.median(batches):,.0f} transitions/s"
        )
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--single", type=int, default=3000)
    parser.add_argument("--batched", type=int, default=30000)
    parser.add_argument("--batch-size", type=int, default=100)
    asyncio.run(main(parser.parse_args()))
