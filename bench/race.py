"""Benchmark (not a test): Celery and sked side by side, in one run on this machine.

Per run (interleaved, each on a fresh stack; Celery goes first in odd runs, sked in even ones,
so that the host's drift within a run falls on both alike; medians of --runs, and the median of
each run's own sked/Celery ratio beside the ratio of the medians):
  1. warm-up: 500 no-op tasks;
  2. submit -> start latency at a paced --rate (default 100 tasks/s) for --seconds: p50 / p99,
     and how busy the machine was meanwhile (near 100 %, every stage waits for a core);
  3. sustained throughput: a burst of --tasks no-op tasks, from the wall time before the first
     submit to the last task finished *as the system recorded it*: sked's max(finished_at) of
     the burst's tasks (one count query on Postgres every 100 ms, on the burst's distinct task
     name), Celery's worker-side task_postrun signal (bench/celery_app.py writes the time of the
     last completion to a file once it has seen the whole burst). No per-task result polling.
     CPU time per task and process over the burst, from /proc (bench/profile.py's helpers);
     sked's window also covers draining its outbox (the burst's events published);
  4. command tasks: a burst of `true` commands through sked (fork + exec per task); for Celery,
     labelled as such, a task that runs subprocess.run(["true"]) -- Celery has no command tasks.

sked: bench/throughput.py's Stack (scheduler, relay, --executors x --slots, each a process;
throwaway database, RabbitMQ vhost, Redis db 15). Default: one executor with 32 slots -- one
node on the machine, the shape of Celery's one worker process with 32 threads; the same 32 slots
split over two executors (--executors 2 --slots 16) cost ~15 % more CPU a task on 2 cores
(docs/performance.md has both). Submits with SkedClient.submit_many in chunks of
500 (the burst) and SkedClient.submit per task (the paced run), every message confirmed.

Celery (the `bench` extra: pip install -e '.[dev,bench]'): the same RabbitMQ on a throwaway
vhost, one worker process: `--pool threads -c --celery-concurrency -O fair`. Choices:
  * threads, not prefork: the task does nothing, so the pool is pure overhead; threads measured
    faster than prefork here (shared/perf-facts.md) and avoid a process hop per task;
  * concurrency defaults to sked's total slots (executors x slots = 32): same parallelism cap;
  * task_acks_late=True: ack after the task ran, so a worker crash loses nothing -- the closest
    Celery gets to sked's guarantee; prefetch multiplier 4 (Celery's default, 128 unacked
    messages at -c 32): short tasks need a deep prefetch, 1 would stall on a round trip per task;
  * no result backend (task_ignore_result): Celery keeps no task state at all, sked keeps a
    durable row and history per task -- the output says so;
  * Celery's defaults otherwise: persistent messages on a durable classic queue, publishes not
    confirmed (sked's client waits for each confirm); the bench sends with send_task reusing
    one producer, as a user batch-submitting (group().apply_async does the same loop);
  * --without-gossip/mingle/heartbeat: one worker has nobody to talk to.

Run, from the checkout (bench is a package, not installed):
    .venv/bin/python -m bench.race [--tasks 5000] [--rate 100] [--seconds 10] [--runs 3]
The machine has 2 cores: a concurrent benchmark skews both systems' figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import asyncpg

from bench.celery_app import NOOP as CELERY_NOOP
from bench.celery_app import QUEUE, make_app
from bench.celery_app import TRUE as CELERY_TRUE
from bench.profile import (
    Snapshot,
    children,
    groups_of,
    machine_busy_seconds,
    pids_named,
    snapshot,
    used,
)
from bench.throughput import ADMIN, NOOP, Stack, pct, settle
from shared.client import SkedClient
from shared.store.db import create_pool

ROOT = Path(__file__).resolve().parents[1]
CELERY = str(Path(sys.executable).with_name("celery"))
TERMINAL = ["success", "failed", "timed_out", "canceled", "skipped"]
TRUE_CMD = {"name": "true", "job": {"kind": "command", "argv": ["true"]}}
WARMUP = 500
# How often sked's side looks whether a burst has ended. The figures come from the tasks'
# own finish times, not from when the poll saw them, so a slower poll loses no precision;
# each poll is a count over the tasks table that Postgres runs while the burst does (every
# 0.1 s it was ~3 % of the CPU a burst task is charged here), where Celery's side waits on
# a file its worker writes.
POLL = 0.5
TIMEOUT = 600.0
STOP = (signal.SIGTERM, signal.SIGINT)

Groups = dict[str, list[int]]


@dataclass
class Result:
    rate: float = 0.0  # tasks/s, the burst
    p50: float = 0.0  # ms, submit -> start
    p99: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # µs/task by process group
    commands: float | None = None  # tasks/s, the `true` burst
    failed: int = 0
    # the machine's busy fraction when the latency run and the burst began (quiet())
    quiet: list[float] = field(default_factory=list)
    # the machine's busy fraction during the latency run: near 1, each stage of a task's way
    # waits for a core, and the latency is that queue's more than the system's
    paced_busy: float = 0.0


# --- CPU, per process, from /proc ---


class Busy:
    """The machine's busy fraction (of all its CPUs) over a `with` block."""

    def __enter__(self) -> Busy:
        self.before, self.start = machine_busy_seconds(), time.monotonic()
        return self

    def __exit__(self, *_: object) -> None:
        cpus = os.cpu_count() or 1
        elapsed = time.monotonic() - self.start
        self.fraction = (machine_busy_seconds() - self.before) / elapsed / cpus


def quiet(window: float = 0.5, busy: float = 0.15, timeout: float = 30.0) -> float:
    """Wait until the machine has been nearly idle (under `busy` of its CPUs over `window`
    seconds), at most `timeout`; returns the busy fraction last seen. Each measurement starts
    from a quiet machine rather than inside the previous phase's after-effects (a checkpoint,
    an autovacuum, RabbitMQ deleting the last stack's vhost), for both systems alike."""
    deadline = time.monotonic() + timeout
    while True:
        with Busy() as seen:
            time.sleep(window)
        if seen.fraction < busy or time.monotonic() >= deadline:
            return seen.fraction


def used_us(before: Snapshot, after_groups: Groups, tasks: int) -> dict[str, float]:
    """µs of CPU per task by group (membership looked up again at the end: bench.profile.used)."""
    return {k: s / tasks * 1e6 for k, s in used(before, snapshot(after_groups)).items()}


def with_children(pid: int) -> list[int]:
    return [pid, *children(pid)]


# --- stopping: SIGTERM and Ctrl-C run the finally blocks, and never cut one short ---


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def stop_on_signals() -> None:
    """The synchronous (Celery) phase: SIGTERM, like Ctrl-C, raises where the bench is."""
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Synchronous cleanup (stop the worker, delete the vhost) runs to its end: a SIGTERM or
    SIGINT arriving meanwhile is acted on after it."""
    got: list[int] = []
    for sig in STOP:
        signal.signal(sig, lambda s, f: got.append(s))
    try:
        yield
    finally:
        stop_on_signals()
        if got:
            raise SystemExit(128 + got[0])


class AsyncStop:
    """The asyncio (sked) phase: an exception raised from a signal handler would land in
    whatever task runs (aio-pika's writer, say) and leave ours half done. So a signal cancels
    the run's task instead (its finally blocks stop the services and drop the stack), is only
    recorded while `cleaning`, and becomes SystemExit once the run is over."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.cleaning = False
        self.task = asyncio.current_task()

    def __enter__(self) -> AsyncStop:
        for sig in STOP:
            asyncio.get_running_loop().add_signal_handler(sig, self._on, sig)
        return self

    def _on(self, sig: int) -> None:
        self.got.append(sig)
        if not self.cleaning and self.task is not None:
            self.task.cancel()

    def __exit__(self, *exc: object) -> None:
        for sig in STOP:
            asyncio.get_running_loop().remove_signal_handler(sig)
        stop_on_signals()
        if self.got:
            raise SystemExit(128 + self.got[0])


# --- Celery ---


@dataclass
class CeleryStack:
    app: Any
    dir: Path
    worker: subprocess.Popen[bytes]


@contextlib.contextmanager
def celery_stack(args: argparse.Namespace, run: int) -> Iterator[CeleryStack]:
    vhost = f"celery_race_{os.getpid()}_{run}"
    out = Path(tempfile.mkdtemp(prefix="sked-race-celery-"))
    worker: subprocess.Popen[bytes] | None = None
    app = None
    ok = False
    try:
        subprocess.run(["rabbitmqctl", "-q", "add_vhost", vhost], check=True)
        subprocess.run(
            ["rabbitmqctl", "-q", "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"],
            check=True,
        )
        broker = f"amqp://guest:guest@127.0.0.1:5672/{quote(vhost, safe='')}"
        env = {
            **os.environ,
            "RACE_BROKER": broker,
            "RACE_DIR": str(out),
            "PYTHONPATH": str(ROOT),
        }
        argv = [CELERY, "-A", "bench.celery_app", "worker", "--pool", "threads"]
        argv += ["-c", str(args.celery_concurrency), "-O", "fair", "-Q", QUEUE]
        argv += ["--loglevel", "WARNING", "--without-gossip", "--without-mingle"]
        argv += ["--without-heartbeat"]
        with (out / "worker.log").open("wb") as log:
            worker = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=log)
        wait_file(out / "ready.json", 60, worker)
        app = make_app(broker)
        yield CeleryStack(app, out, worker)
        ok = True
    finally:
        with uninterrupted():
            if app is not None:
                app.close()
            if worker is not None:
                worker.terminate()
                try:
                    worker.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()
            subprocess.run(["rabbitmqctl", "-q", "delete_vhost", vhost], check=False)
            if ok:
                shutil.rmtree(out, ignore_errors=True)
            else:
                print(f"celery worker log kept in {out}", file=sys.stderr)


def wait_file(path: Path, timeout: float, worker: subprocess.Popen[bytes]) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if worker.poll() is not None:
            raise RuntimeError(f"celery worker exited ({worker.returncode}); see {path.parent}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} after {timeout:g} s")
        time.sleep(POLL)
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def celery_send(cs: CeleryStack, task: str, tag: str, n: int) -> float:
    start = time.time()
    with cs.app.producer_or_acquire() as producer:
        for _ in range(n):
            cs.app.send_task(task, args=(tag, n), producer=producer)
    return start


def celery_burst(cs: CeleryStack, task: str, tag: str, n: int) -> tuple[float, int]:
    start = celery_send(cs, task, tag, n)
    done = wait_file(cs.dir / f"{tag}.json", TIMEOUT, cs.worker)
    return n / (done["last"] - start), int(done["failed"])


def celery_paced(cs: CeleryStack, rate: float, seconds: float, tag: str) -> list[float]:
    n = int(rate * seconds)
    sent: dict[str, float] = {}
    start = time.perf_counter()
    with cs.app.producer_or_acquire() as producer:
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            task_id = str(uuid.uuid4())
            sent[task_id] = time.time()
            cs.app.send_task(CELERY_NOOP, args=(tag, n), task_id=task_id, producer=producer)
    starts = wait_file(cs.dir / f"{tag}.json", TIMEOUT, cs.worker)["starts"]
    return [(starts[t] - sent[t]) * 1000 for t in sent if t in starts]


def celery_run(args: argparse.Namespace, run: int) -> Result:
    res = Result()
    with celery_stack(args, run) as cs:
        celery_burst(cs, CELERY_NOOP, f"warm-{run}", WARMUP)
        res.quiet.append(quiet())
        with Busy() as busy:
            lat = celery_paced(cs, args.rate, args.seconds, f"lat-{run}")
        res.paced_busy = busy.fraction
        res.p50, res.p99 = pct(lat, 50), pct(lat, 99)
        groups = {
            "celery worker": with_children(cs.worker.pid),
            "rabbitmq": pids_named("beam.smp"),
            "bench client": [os.getpid()],
        }
        res.quiet.append(quiet())
        before = snapshot(groups)
        res.rate, res.failed = celery_burst(cs, CELERY_NOOP, f"burst-{run}", args.tasks)
        groups["celery worker"] = with_children(cs.worker.pid)
        res.cpu = used_us(before, groups, args.tasks)
        if not args.skip_commands:
            res.commands, failed = celery_burst(cs, CELERY_TRUE, f"true-{run}", args.tasks)
            res.failed += failed
    return res


# --- sked ---


async def sked_done(pool: asyncpg.Pool, name: str, n: int) -> asyncpg.Record:
    """Poll (one count query per POLL) until n tasks named `name` are terminal."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        row = await pool.fetchrow(
            "SELECT count(*) AS done, count(*) FILTER (WHERE status <> 'success') AS failed,"
            " max(finished_at) AS last FROM tasks WHERE name = $1 AND status = ANY($2::text[])",
            name,
            TERMINAL,
        )
        if row["done"] >= n:
            return row
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: {row['done']} of {n} tasks finished")
        await asyncio.sleep(POLL)


async def sked_burst(
    client: SkedClient, pool: asyncpg.Pool, spec: dict[str, Any], name: str, n: int
) -> tuple[float, int]:
    spec = {**spec, "name": name}
    start = time.time()
    for i in range(0, n, 500):
        await client.submit_many([spec] * min(500, n - i))
    row = await sked_done(pool, name, n)
    return n / (row["last"].timestamp() - start), int(row["failed"])


async def sked_paced(
    client: SkedClient, pool: asyncpg.Pool, rate: float, seconds: float, name: str
) -> list[float]:
    n = int(rate * seconds)
    spec = {**NOOP, "name": name}
    submitted: dict[str, float] = {}
    start = time.perf_counter()
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        wall = time.time()
        submitted[str(await client.submit(spec))] = wall
    await sked_done(pool, name, n)
    rows = await pool.fetch("SELECT id, started_at FROM tasks WHERE name = $1", name)
    return [
        (r["started_at"].timestamp() - submitted[str(r["id"])]) * 1000
        for r in rows
        if r["started_at"] is not None and str(r["id"]) in submitted
    ]


async def sked_groups(stack: Stack, pool: asyncpg.Pool) -> Groups:
    groups = groups_of(stack)
    # only this database's backends and the server's own processes (WAL writer, checkpointer,
    # ...): another benchmark's backends are not this run's cost
    rows = await pool.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 OR datname IS NULL", stack.name
    )
    groups["postgres"] = [r["pid"] for r in rows]
    return groups


async def other_benches(stack: Stack) -> list[str]:
    """Live bench stacks besides ours: they share Redis db 15 (Stack flushes it on start)."""
    admin = await asyncpg.connect(ADMIN)
    try:
        names = await admin.fetch(
            "SELECT datname FROM pg_database WHERE datname LIKE 'sked_bench_%'"
        )
    finally:
        await admin.close()
    live = []
    for r in names:
        pid = r["datname"].rsplit("_", 1)[1]
        if r["datname"] != stack.name and pid.isdigit() and _is_bench(int(pid)):
            live.append(r["datname"])
    return live


def _is_bench(pid: int) -> bool:
    """Whether process `pid` is a bench (a killed bench leaves its database behind, and its
    pid may since name any other process)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(b"bench" in arg for arg in argv[1:3])


async def sked_run(args: argparse.Namespace, run: int) -> Result:
    with AsyncStop() as stop:
        return await _sked_run(args, run, stop)


async def _sked_run(args: argparse.Namespace, run: int, stop: AsyncStop) -> Result:
    res = Result()
    stack = Stack(args)
    for _ in range(360):
        others = await other_benches(stack)
        if not others:
            break
        print(f"waiting for {', '.join(others)} to end (it shares Redis db 15)", flush=True)
        await asyncio.sleep(10)
    else:
        raise RuntimeError("another bench stack is still running")
    # each executor's state dir defaults to $TMPDIR/sked/<node id>: a private TMPDIR keeps ours
    # apart from another bench's executors of the same node ids
    tmp = Path(tempfile.mkdtemp(prefix="sked-race-tmp-"))
    old_tmp = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp)
    client: SkedClient | None = None
    pool: asyncpg.Pool | None = None
    ok = False
    try:
        settings = await stack.__aenter__()
        client = SkedClient(settings)
        pool = await create_pool(settings.database_url, 2)
        await sked_burst(client, pool, NOOP, f"race-warm-{run}", WARMUP)
        await settle(pool)
        res.quiet.append(quiet())
        with Busy() as busy:
            lat = await sked_paced(client, pool, args.rate, args.seconds, f"race-lat-{run}")
        res.paced_busy = busy.fraction
        res.p50, res.p99 = pct(lat, 50), pct(lat, 99)
        await settle(pool)
        res.quiet.append(quiet())
        before = snapshot(await sked_groups(stack, pool))
        name = f"race-burst-{run}"
        res.rate, res.failed = await sked_burst(client, pool, NOOP, name, args.tasks)
        await settle(pool)  # the burst's events published: part of what it cost
        res.cpu = used_us(before, await sked_groups(stack, pool), args.tasks)
        if not args.skip_commands:
            name = f"race-cmd-{run}"
            res.commands, failed = await sked_burst(client, pool, TRUE_CMD, name, args.tasks)
            res.failed += failed
        ok = True
    finally:
        stop.cleaning = True  # a signal now waits for the cleanup to end
        if pool is not None:
            await pool.close()
        if client is not None:
            await client.close()
        await stack.__aexit__(None, None, None)  # safe after a partial start too
        if old_tmp is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_tmp
        shutil.rmtree(tmp, ignore_errors=True)
        if ok:
            shutil.rmtree(stack.dir, ignore_errors=True)
        else:
            print(f"sked service logs kept in {stack.dir}", file=sys.stderr)
    return res


# --- output ---


def cpu_line(cpu: dict[str, float]) -> str:
    parts = " · ".join(f"{name} {us:,.0f}" for name, us in cpu.items())
    return f"{parts} = {sum(cpu.values()):,.0f}"


def run_line(system: str, run: int, args: argparse.Namespace, res: Result, cmd: str) -> str:
    line = f"run {run + 1}/{args.runs} {system}: submit->start at {args.rate:g}/s p50 "
    line += f"{res.p50:.1f} ms, p99 {res.p99:.1f} ms ({res.paced_busy:.0%} busy); "
    line += f"burst of {args.tasks}: "
    line += f"{res.rate:,.0f} tasks/s; CPU µs/task: {cpu_line(res.cpu)}"
    if res.commands is not None:
        line += f"; {cmd}: {res.commands:,.0f} tasks/s"
    if res.failed:
        line += f"; {res.failed} TASKS FAILED"
    if res.quiet:
        line += f"; busy at the start of each: {', '.join(f'{b:.0%}' for b in res.quiet)}"
    return line


def median_of(results: list[Result]) -> Result:
    cpu = {}
    for name in results[0].cpu:
        cpu[name] = statistics.median(r.cpu.get(name, 0.0) for r in results)
    commands = [r.commands for r in results if r.commands is not None]
    return Result(
        rate=statistics.median(r.rate for r in results),
        p50=statistics.median(r.p50 for r in results),
        p99=statistics.median(r.p99 for r in results),
        cpu=cpu,
        commands=statistics.median(commands) if commands else None,
        failed=sum(r.failed for r in results),
        paced_busy=statistics.median(r.paced_busy for r in results),
    )


STATE = {
    "celery": "none (no result backend)",
    "sked": "durable row + events per task",
}
COMMANDS = {
    "celery": 'a task running subprocess.run(["true"]) (not a command task)',
    "sked": "`true` command tasks (fork + exec each)",
}


def summary(args: argparse.Namespace, results: dict[str, list[Result]]) -> None:
    med = {system: median_of(rs) for system, rs in results.items() if rs}
    print(
        f"\nmedian of {args.runs} run(s): bursts of {args.tasks} no-op tasks, latency paced at "
        f"{args.rate:g}/s for {args.seconds:g} s; sked {args.executors} executors x "
        f"{args.slots} slots, Celery 1 worker, threads x {args.celery_concurrency}, acks late"
    )
    print(f"{'system':8} {'tasks/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'CPU µs/task':>12}  state")
    for system, m in med.items():
        print(
            f"{system:8} {m.rate:>9,.0f} {m.p50:>7.1f} {m.p99:>7.1f} "
            f"{sum(m.cpu.values()):>12,.0f}  {STATE[system]}"
        )
    if "sked" in med and "celery" in med:
        sk, ce = med["sked"], med["celery"]
        print(
            f"sked/celery: throughput {sk.rate / ce.rate:.2f}x, CPU per task "
            f"{sum(sk.cpu.values()) / sum(ce.cpu.values()):.2f}x"
        )
        # each run's own ratio (its two bursts minutes apart, on the same spell of the host)
        ratios = [s.rate / c.rate for s, c in zip(results["sked"], results["celery"], strict=True)]
        print(
            f"sked/celery throughput by run: {', '.join(f'{r:.2f}x' for r in ratios)}; "
            f"median {statistics.median(ratios):.2f}x"
        )
    busy = ", ".join(f"{system} {m.paced_busy:.0%}" for system, m in med.items())
    print(f"the machine busy during the paced run, of its {os.cpu_count()} CPUs (median): {busy}")
    print("CPU µs/task by process (median; RabbitMQ and Redis are shared servers):")
    for system, m in med.items():
        print(f"  {system:7} {cpu_line(m.cpu)}")
    for system, m in med.items():
        if m.commands is not None:
            print(f"{system}: {COMMANDS[system]}: {m.commands:,.0f} tasks/s")
    failed = sum(m.failed for m in med.values())
    if failed:
        print(f"WARNING: {failed} tasks did not succeed")


def main(args: argparse.Namespace) -> None:
    stop_on_signals()
    results: dict[str, list[Result]] = {"celery": [], "sked": []}
    for run in range(args.runs):
        # who goes first alternates (Celery, sked; sked, Celery; ...): the host drifts within
        # a run, and a fixed order would hand that drift to one system every time
        for system in ("celery", "sked") if run % 2 == 0 else ("sked", "celery"):
            if system == "celery" and not args.skip_celery:
                res = celery_run(args, run)
                print(run_line("celery", run, args, res, "subprocess(true) task"), flush=True)
            elif system == "sked":
                res = asyncio.run(sked_run(args, run))
                print(run_line("sked", run, args, res, "`true` commands"), flush=True)
            else:
                continue
            results[system].append(res)
    summary(args, results)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=5000, help="burst size")
    parser.add_argument("--rate", type=float, default=100, help="paced latency run, tasks/s")
    parser.add_argument("--seconds", type=float, default=10, help="paced latency run length")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--executors", type=int, default=1)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument(
        "--prefetch", type=int, default=None, help="SKED_PREFETCH per executor (default: unset)"
    )
    parser.add_argument(
        "--celery-concurrency",
        type=int,
        help="worker threads (default: executors x slots, sked's total slots)",
    )
    parser.add_argument("--skip-celery", action="store_true")
    parser.add_argument("--skip-commands", action="store_true", help="no `true` bursts")
    parsed = parser.parse_args()
    if parsed.celery_concurrency is None:
        parsed.celery_concurrency = parsed.executors * parsed.slots
    main(parsed)
