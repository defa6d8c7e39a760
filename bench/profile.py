"""Benchmark (not a test): where a burst's CPU goes, per process, and (with --py-spy) where in
each service's code.

Runs the stack of bench/throughput.py, submits a burst (or, with --rate R, one task at a time
at R tasks/s: what a task costs when nothing batches), and reads each process's CPU time from
/proc before and after: the services (by pid), every Postgres backend, RabbitMQ (beam.smp),
Redis, and this client. With --py-spy DIR it records a py-spy profile of each service during
the burst (speedscope JSON, one file per service; open at https://www.speedscope.app); with
--perf FILE, a `perf record -a -g` of the whole machine, kernel included (`perf report -i FILE
--sort comm,dso,sym`). Run, from the checkout (bench is a package, not installed):
    .venv/bin/python -m bench.profile [--tasks 5000] [--rate 100] [--executors 1 --slots 32]
        [--py-spy /tmp/prof] [--perf /tmp/perf.data]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

from bench.throughput import NOOP, Stack, burst, settle
from shared.client import SkedClient
from shared.store.db import create_pool

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU of one process in seconds (0 if it is gone): its own (utime + stime) and that of
    the children it has reaped (cutime + cstime) — a warden's shims and the programs they ran
    live a few milliseconds each and are gone by the time anyone could read their own."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / TICK


def machine_busy_seconds() -> float:
    """CPU time every core spent busy (not idle, not waiting on I/O), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / TICK


def pids_named(*names: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if comm in names:
                out.append(int(entry.name))
    return out


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (the executors' handler workers)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        found += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return found


Snapshot = dict[str, dict[int, float]]


def snapshot(groups: dict[str, list[int]]) -> Snapshot:
    return {name: {p: cpu_seconds(p) for p in pids} for name, pids in groups.items()}


def used(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds by group between two snapshots, each taken of the groups as they were
    then: a process that appeared between them (a new Postgres backend, a shim or handler
    worker forked for the burst) counts in full; one that exited is lost (its time is gone
    from /proc, unless its parent reaped it: cpu_seconds)."""
    out = {}
    for name in [*before, *(n for n in after if n not in before)]:
        b, a = before.get(name, {}), after.get(name, {})
        out[name] = sum(max(0.0, t - b.get(pid, 0.0)) for pid, t in a.items())
    return out


def label(proc: subprocess.Popen[bytes], sep: str = " ") -> str:
    """A stack process's name: its service, and an executor's node id ("executor bench-0")."""
    return sep.join(proc.args[2:5:2])  # type: ignore[index]


def groups_of(stack: Stack) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for proc in stack.procs:
        name = label(proc)
        if name in groups:  # a second scheduler
            name = f"{name} {sum(n.startswith(name) for n in groups) + 1}"
        groups[name] = [proc.pid]
        kids = children(proc.pid)
        if kids:
            groups[f"{name} (workers)"] = kids
    groups["postgres"] = pids_named("postgres")
    groups["rabbitmq"] = pids_named("beam.smp")
    groups["redis"] = pids_named("redis-server")
    groups["bench client"] = [os.getpid()]
    return groups


async def _sample_waits(dsn: str, waits: collections.Counter[str]) -> None:
    """Every 20 ms: what each of the sked database's busy sessions is doing or waiting for."""
    conn = await asyncpg.connect(dsn)
    try:
        while True:
            rows = await conn.fetch(
                "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') AS w,"
                " left(regexp_replace(query, '\\s+', ' ', 'g'), 60) AS q FROM pg_stat_activity"
                " WHERE datname = current_database() AND state = 'active'"
                " AND pid <> pg_backend_pid()"
            )
            waits["samples"] += 1
            for r in rows:
                waits[f"{r['w']:28} {r['q']}"] += 1
            await asyncio.sleep(0.02)
    finally:
        await conn.close()


STAGES = ("ready", "scheduling", "running", "success")


async def _print_stages(pool: asyncpg.Pool, name: str) -> None:
    """How long the burst's tasks spent between the transitions of their life (event times)."""
    rows = await pool.fetch(
        "SELECT e.task_id, e.to_status, e.at FROM task_events e JOIN tasks t ON t.id = e.task_id"
        " WHERE t.name = $1",
        name,
    )
    at: dict[object, dict[str, float]] = {}
    for r in rows:
        at.setdefault(r["task_id"], {})[r["to_status"]] = r["at"].timestamp()
    print(f"time between transitions, ms (p50 / p90 / p99), {len(at)} tasks, {len(rows)} events:")
    for a, b in itertools.pairwise(STAGES):
        gaps = sorted((t[b] - t[a]) * 1000 for t in at.values() if a in t and b in t)
        if gaps:
            p50, p90 = gaps[len(gaps) // 2], gaps[int(len(gaps) * 0.9)]
            p99 = gaps[int(len(gaps) * 0.99)]
            print(f"  {a:>10} -> {b:<10} {p50:8.1f} / {p90:8.1f} / {p99:8.1f}")


async def _statements_on(pool: asyncpg.Pool) -> bool:
    """Reset pg_stat_statements when the server loads it (shared_preload_libraries)."""
    try:
        await pool.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        await pool.execute("SELECT pg_stat_statements_reset()")
    except asyncpg.PostgresError:
        return False
    return True


async def _print_statements(pool: asyncpg.Pool, tasks: int) -> None:
    rows = await pool.fetch(
        "SELECT calls, rows, total_exec_time + total_plan_time AS total_exec_time, query"
        " FROM pg_stat_statements"
        " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " ORDER BY total_exec_time + total_plan_time DESC LIMIT 25"
    )
    print("statements by total time, planning and execution (pg_stat_statements):")
    for r in rows:
        query = " ".join(r["query"].split())[:110]
        print(
            f"  {r['total_exec_time']:8.0f} ms {r['calls']:6} calls "
            f"{r['total_exec_time'] * 1000 / tasks:6.0f} µs/task {r['rows']:7} rows  {query}"
        )


TRUE = {"name": "true", "job": {"kind": "command", "argv": ["true"]}}


async def quiet_burst(
    client: SkedClient,
    pool: asyncpg.Pool,
    n: int,
    job: dict[str, Any] = NOOP,
    rate: float | None = None,
) -> tuple[float, str]:
    """A burst of `n` no-op tasks (or, at `rate`, one submission every 1/rate s), waited for
    with one count query every 0.5 s (the SDK's wait_all reads the tasks each notification
    names: a load on the system measured). Returns tasks/s by their own finish times."""
    name = f"burst-{time.monotonic_ns()}"
    spec = {**job, "name": name}
    start = time.time()
    if rate is None:
        for i in range(0, n, 500):
            await client.submit_many([spec] * min(500, n - i))
    else:
        paced = time.perf_counter()
        for i in range(n):
            await asyncio.sleep(max(0.0, paced + i / rate - time.perf_counter()))
            await client.submit(spec)
    while True:
        row = await pool.fetchrow(
            "SELECT count(*) AS n, max(finished_at) AS last FROM tasks"
            " WHERE name = $1 AND status = 'success'",
            name,
        )
        if row["n"] >= n:
            return n / (row["last"].timestamp() - start), name
        await asyncio.sleep(0.5)


async def main(args: argparse.Namespace) -> None:
    stack = Stack(args)
    async with stack as settings:
        client = SkedClient(settings)
        pool = await create_pool(settings.database_url, 2)
        await burst(client, 500)  # warm up
        await settle(pool)
        groups = groups_of(stack)
        spies = []
        if args.py_spy:
            out = Path(args.py_spy)
            out.mkdir(parents=True, exist_ok=True)
            spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
            for proc in stack.procs:
                name = label(proc, "-")
                spies.append(
                    subprocess.Popen(
                        [
                            *(spy, "record", "-p", str(proc.pid), "-f", "speedscope"),
                            *("-r", "200", "--nonblocking", "-o", str(out / f"{name}.json")),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        perf = None
        if args.perf:
            # the whole machine, kernel included: where the syscalls of a send or a wake-up go
            perf = subprocess.Popen(
                ["perf", "record", "-a", "-g", "-F", "499", "-o", args.perf],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        statements = await _statements_on(pool)
        before, wall = snapshot(groups), time.perf_counter()
        busy = machine_busy_seconds()
        job = TRUE if args.command else NOOP
        waits: collections.Counter[str] = collections.Counter()
        sampler = asyncio.create_task(_sample_waits(settings.database_url, waits))
        rate, burst_name = await quiet_burst(client, pool, args.tasks, job, args.rate)
        sampler.cancel()
        wall = time.perf_counter() - wall
        groups = groups_of(stack)  # again: with the processes born during the burst
        after = snapshot(groups)
        busy = machine_busy_seconds() - busy
        for s in spies if perf is None else [*spies, perf]:
            s.send_signal(2)
        for s in spies if perf is None else [*spies, perf]:
            s.wait(timeout=60)
        await settle(pool)
        total = 0.0
        print(f"{args.tasks} tasks at {rate:,.0f} tasks/s ({wall:.1f} s wall); CPU by process:")
        for name, cpu in used(before, after).items():
            total += cpu
            print(
                f"  {name:28} {cpu:6.2f} s  {cpu / wall * 100:5.0f} % of a core  "
                f"{cpu / args.tasks * 1e6:6.0f} µs/task"
            )
        print(f"  {'all':28} {total:6.2f} s  {total / wall * 100:5.0f} % (2 cores = 200 %)")
        print(
            f"  {'machine (/proc/stat)':28} {busy:6.2f} s  {busy / wall * 100:5.0f} %  "
            f"{busy / args.tasks * 1e6:6.0f} µs/task"
        )
        await _print_stages(pool, burst_name)
        samples = waits.pop("samples", 1)
        print(f"what the database's sessions were doing ({samples} samples, sessions per sample):")
        for what, n in waits.most_common(12):
            print(f"  {n / samples:6.2f}  {what}")
        if statements:
            await _print_statements(pool, args.tasks)
        await pool.close()
        await client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument(
        "--prefetch", type=int, default=None, help="SKED_PREFETCH per executor (default: unset)"
    )
    parser.add_argument("--schedulers", type=int, default=1)
    parser.add_argument("--command", action="store_true", help="`true` commands, not handlers")
    parser.add_argument("--py-spy", metavar="DIR", help="record a py-spy profile per service")
    parser.add_argument(
        "--perf", metavar="FILE", help="`perf record -a -g` of the machine during the burst"
    )
    parser.add_argument(
        "--rate", type=float, help="submit one task at a time at this rate (tasks/s), not a burst"
    )
    asyncio.run(main(parser.parse_args()))
