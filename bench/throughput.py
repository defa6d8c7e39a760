"""Benchmark (not a test): no-op handler tasks through the whole pipeline.

Starts a scheduler, a relay and executors as separate processes against a throwaway database,
RabbitMQ vhost and Redis database, then measures
  1. submit -> start latency at a paced rate (default 200 tasks/s): p50 / p99;
  2. sustained throughput: a burst of N tasks, first submit -> last task finished.
Run: .venv/bin/python bench/throughput.py [--tasks 5000] [--rate 200] [--seconds 10] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import asyncpg
from redis.asyncio import Redis

from shared.client import SkedClient
from shared.settings import Settings
from shared.store.db import create_pool
from shared.store.migrate import migrate

ADMIN = os.environ.get("SKED_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
SKED = str(Path(sys.executable).with_name("sked"))
NOOP = {"name": "noop", "job": {"kind": "handler", "handler": "bench.jobs:noop"}}


class Stack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name = f"sked_bench_{os.getpid()}"
        self.dir = Path(tempfile.mkdtemp(prefix="sked-bench-"))
        self.procs: list[subprocess.Popen[bytes]] = []

    async def __aenter__(self) -> Settings:
        admin = await asyncpg.connect(ADMIN)
        await admin.execute(f'CREATE DATABASE "{self.name}"')
        await admin.close()
        dsn = ADMIN.rsplit("/", 1)[0] + "/" + self.name
        await migrate(dsn)
        subprocess.run(["rabbitmqctl", "-q", "add_vhost", self.name], check=True)
        subprocess.run(
            ["rabbitmqctl", "-q", "set_permissions", "-p", self.name, "guest", ".*", ".*", ".*"],
            check=True,
        )
        redis_url = "redis://127.0.0.1:6379/15"  # the tests use 1-13: a bench never empties theirs
        r = Redis.from_url(redis_url)
        await r.flushdb()
        await r.aclose()
        self.settings = Settings(
            database_url=dsn,
            rabbitmq_url=f"amqp://guest:guest@127.0.0.1:5672/{quote(self.name, safe='')}",
            redis_url=redis_url,
        )
        env = {
            **os.environ,
            "SKED_DATABASE_URL": self.settings.database_url,
            "SKED_RABBITMQ_URL": self.settings.rabbitmq_url,
            "SKED_REDIS_URL": redis_url,
            "SKED_LOG_LEVEL": "WARNING",
            # every slot's handler worker up front: the figures are steady state, not start-up
            "SKED_WARM_WORKERS": str(self.args.slots),
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
            "SKED_TASK_ENV_PASS": "PYTHONPATH",  # the handlers are this checkout's
            "SKED_HEARTBEAT_SECRET": secrets.token_hex(32),
        }
        env.pop("SKED_PREFETCH", None)  # unset: sked's default, a backlog earned by short tasks
        if getattr(self.args, "prefetch", None) is not None:
            env["SKED_PREFETCH"] = str(self.args.prefetch)
        schedulers = [["scheduler"]] * getattr(self.args, "schedulers", 1)
        # the two services a burst of short tasks never needs, for benches that watch all
        watchers = [["heartbeat-monitor"], ["recovery"]] if getattr(self.args, "all", False) else []
        services = [*schedulers, ["relay"], *watchers] + [
            ["executor", "--node-id", f"bench-{i}", "--slots", str(self.args.slots)]
            for i in range(self.args.executors)
        ]
        for argv in services:
            log = (self.dir / f"{argv[0]}-{len(self.procs)}.log").open("wb")
            self.procs.append(
                subprocess.Popen([SKED, "service", *argv], env=env, stdout=log, stderr=log)
            )
        await self._wait_for_nodes()
        return self.settings

    async def _wait_for_nodes(self) -> None:
        conn = await asyncpg.connect(self.settings.database_url)
        try:
            for _ in range(300):
                if await conn.fetchval("SELECT count(*) FROM nodes") >= self.args.executors:
                    await asyncio.sleep(1.0)  # let the scheduler finish starting too
                    return
                await asyncio.sleep(0.1)
            raise RuntimeError(f"executors did not register; logs in {self.dir}")
        finally:
            await conn.close()

    async def __aexit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        admin = await asyncpg.connect(ADMIN)
        await admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        await admin.close()
        subprocess.run(["rabbitmqctl", "-q", "delete_vhost", self.name], check=False)


async def burst(client: SkedClient, n: int) -> float:
    start = time.perf_counter()
    ids = []
    for i in range(0, n, 500):
        ids.extend(await client.submit_many([NOOP] * min(500, n - i)))
    await client.wait_all(ids, timeout=600)
    elapsed = time.perf_counter() - start
    return n / elapsed


async def settle(pool: asyncpg.Pool) -> None:
    """Wait until the relay has published the burst's events."""
    for _ in range(1200):
        if not await pool.fetchval("SELECT count(*) FROM outbox"):
            return
        await asyncio.sleep(0.1)


async def paced(client: SkedClient, rate: float, seconds: float) -> list[float]:
    interval = 1.0 / rate
    submitted: dict[object, float] = {}
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        target = start + i * interval
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        wall = time.time()
        task_id = await client.submit(NOOP)
        submitted[task_id] = wall
    done = await client.wait_all(list(submitted), timeout=600)
    return [
        (t.started_at.timestamp() - submitted[t.id]) * 1000
        for t in done.values()
        if t.started_at is not None
    ]


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    rates, p50s, p99s = [], [], []
    for run in range(args.runs):
        async with Stack(args) as settings:
            client = SkedClient(settings)
            pool = await create_pool(settings.database_url, 2)
            await burst(client, 500)  # warm up workers, connections and caches
            await settle(pool)
            # latency first, at a steady paced load; then the burst (whose cleanup — outbox
            # draining, vacuum of the dead rows it leaves — would otherwise load the paced run)
            lat = await paced(client, args.rate, args.seconds)
            p50s.append(pct(lat, 50))
            p99s.append(pct(lat, 99))
            line = f"run {run + 1}: submit->start at {args.rate:g}/s: p50 {p50s[-1]:.1f} ms, "
            line += f"p99 {p99s[-1]:.1f} ms"
            if args.tasks:
                await settle(pool)
                rates.append(await burst(client, args.tasks))
                line += f"; {rates[-1]:,.0f} tasks/s sustained ({args.tasks} tasks)"
            print(line, flush=True)
            await pool.close()
            await client.close()
    summary = (
        f"median of {args.runs}: submit->start at {args.rate:g}/s p50 "
        f"{statistics.median(p50s):.1f} ms, p99 {statistics.median(p99s):.1f} ms"
    )
    if rates:
        summary += f"; {statistics.median(rates):,.0f} tasks/s sustained"
    print(
        f"{summary} ({args.executors} executors x {args.slots} slots, prefetch {args.prefetch}, "
        f"{args.schedulers} scheduler(s), 1 relay)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=5000, help="burst size; 0: latency only")
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument(
        "--prefetch", type=int, default=None, help="SKED_PREFETCH per executor (default: unset)"
    )
    parser.add_argument("--schedulers", type=int, default=1)
    asyncio.run(main(parser.parse_args()))
