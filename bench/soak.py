"""Benchmark (not a test): many bursts through one stack, watching for what grows.

A scheduler, a relay, a heartbeat-monitor, recovery and executors run as separate processes
(bench/throughput.py's stack); `--rounds` bursts of `--tasks` no-op handler tasks go through
them one after another, and after each this prints the round's rate, each process's memory
(its proportional set size, MiB; an executor's handler workers summed apart) and the
database's size and dead rows; at the end, what the two reads that walk dead index entries
cost as the tables were left and after a VACUUM, and the bytes a task takes in each table
with its indexes. A service whose memory keeps rising round after round holds something per
task it should not; a read whose buffers grow with the rounds is a statement that walks
history. Bursts stay under the backlog that enters partial degrade mode
(SKED_DEGRADE_WAITING, 10,000). The development server runs with autovacuum off: `--vacuum`
vacuums between rounds as a working autovacuum would, `--reset` empties the task tables
between rounds (the control: every round on young tables), `--paced R` measures submit ->
start at R tasks/s after the rounds.

Run, from the checkout: .venv/bin/python -m bench.soak [--rounds 10] [--tasks 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import asyncpg

from bench.profile import children, label
from bench.race import Busy
from bench.throughput import Stack, burst, paced, pct, settle
from shared.client import SkedClient
from shared.store.db import create_pool
from shared.store.queries import Q


def pss_mib(pids: list[int]) -> float:
    """The proportional set size of these processes, summed: each page shared by n processes
    counts 1/n in each, so 32 handler workers forked alike are not counted 32 times over."""
    total = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue  # a worker replaced since it was listed
        for line in rollup.splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    return total / 1024


def memory(stack: Stack) -> dict[str, float]:
    """MiB by process: each service, and an executor's handler workers as one figure."""
    out: dict[str, float] = {}
    for proc in stack.procs:
        name = label(proc)
        out[name] = pss_mib([proc.pid])
        kids = children(proc.pid)
        if kids:
            out[f"{name} workers"] = pss_mib(kids)
    return out


async def main(args: argparse.Namespace) -> None:
    stack = Stack(args)
    async with stack as settings:
        client = SkedClient(settings)
        pool = await create_pool(settings.database_url, 2)
        try:
            await burst(client, 500)  # warm up workers, connections and caches
            await settle(pool)
            first = memory(stack)
            head = "round  tasks/s  database MiB  dead tasks · outbox (vacuums)  "
            print(head + "  ".join(first), flush=True)
            print(f"{'start':>5}  {'':>7}  {'':>12}  {'':>29}  " + _cells(first, first), flush=True)
            for round_ in range(1, args.rounds + 1):
                rate = await burst(client, args.tasks)
                await settle(pool)
                if args.vacuum:
                    await pool.execute(f"VACUUM {args.vacuum}")
                if args.reset:
                    await pool.execute("TRUNCATE tasks, task_events, outbox CASCADE")
                size = await pool.fetchval("SELECT pg_database_size(current_database())")
                dead = await vacuuming(pool)
                now = memory(stack)
                print(
                    f"{round_:>5}  {rate:>7,.0f}  {size / 2**20:>12,.0f}  {dead:>29}  "
                    + _cells(now, first),
                    flush=True,
                )
            if args.paced:
                with Busy() as busy:
                    latency = await paced(client, args.paced, 10.0)
                print(
                    f"submit -> start at {args.paced:g}/s after the rounds: p50 "
                    f"{pct(latency, 50):.1f} ms, p99 {pct(latency, 99):.1f} ms, "
                    f"the machine {busy.fraction:.0%} busy",
                    flush=True,
                )
                await settle(pool)
            print(await churned_reads(pool))
            tasks = await pool.fetchval("SELECT count(*) FROM tasks") or 1
            rows = await pool.fetch(
                "SELECT relname, pg_total_relation_size(oid) AS bytes FROM pg_class"
                " WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace"
                " ORDER BY bytes DESC LIMIT 5"
            )
            print(
                f"bytes a task ({tasks:,} tasks), each table with its indexes and TOAST: "
                + ", ".join(f"{r['relname']} {r['bytes'] / tasks:,.0f}" for r in rows)
            )
        finally:
            await pool.close()
            await client.close()


# The two reads of a task's way whose index scans walk the entries of the rows gone before
# them until a vacuum: the relay's (the outbox along its primary key, from its start) and
# placement's usage (tasks_active_by_node, which every attempt enters and leaves).
CHURNED = {
    "relay's read": (Q.unpublished.sql, (list(range(16)), 1000)),
    "placement's usage": (Q.nodes_with_usage.sql, (3600.0,)),
}


async def churned_reads(pool: asyncpg.Pool) -> str:
    """Buffers and ms of each churned read, as the soak left the tables and after a VACUUM."""
    out = []
    for when in ("as left", "after VACUUM"):
        if when != "as left":
            await pool.execute("VACUUM tasks, outbox")
        for name, (sql, args) in CHURNED.items():
            async with pool.acquire() as conn:
                await conn.fetch(sql, *args)  # marks what is dead as such
                start = time.perf_counter()
                await conn.fetch(sql, *args)
                ms = (time.perf_counter() - start) * 1000
                plan = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", *args)
            hit = json.loads(plan[0][0])[0]["Plan"]["Shared Hit Blocks"]
            out.append(f"{name} {when}: {ms:.2f} ms, {hit:,} buffers")
    return "; ".join(out)


async def vacuuming(pool: asyncpg.Pool) -> str:
    """Dead row versions left in `tasks` and `outbox`, and how often either was vacuumed (by
    autovacuum, or a relay: SKED_RELAY_VACUUM_ROWS): a burst leaves four versions a task and
    six deleted outbox rows, which only a vacuum makes room of again."""
    rows = await pool.fetch(
        "SELECT relname, n_dead_tup, vacuum_count + autovacuum_count AS vacuums"
        " FROM pg_stat_user_tables"
        " WHERE relname IN ('tasks', 'outbox') ORDER BY relname DESC"
    )
    dead = " · ".join(f"{r['n_dead_tup']:,}" for r in rows)
    return f"{dead} ({'/'.join(str(r['vacuums']) for r in rows)})"


def _cells(now: dict[str, float], first: dict[str, float]) -> str:
    return "  ".join(f"{now.get(k, 0):>{len(k)}.1f}" for k in first)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=5000, help="a burst; under 10,000")
    parser.add_argument(
        "--vacuum",
        default="",
        help="tables to VACUUM after each round (e.g. 'outbox' or 'tasks, outbox'): what a"
        " working autovacuum would do, on a server that has it off",
    )
    parser.add_argument(
        "--reset",
        action="store_true",
        help="empty the task tables after each round: the control, every round on young tables",
    )
    parser.add_argument(
        "--paced",
        type=float,
        default=0,
        help="after the rounds, submit one task at a time at this rate for 10 s: what a task's"
        " latency is on the tables the rounds left",
    )
    parser.add_argument("--executors", type=int, default=1)
    parser.add_argument("--slots", type=int, default=32)
    parser.set_defaults(all=True)  # the stack's heartbeat-monitor and recovery too
    asyncio.run(main(parser.parse_args()))
