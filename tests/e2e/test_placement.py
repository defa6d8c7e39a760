"""Placement end to end: nodes of different sizes, tasks with resources and selectors, services
as separate processes against real Postgres, Redis and RabbitMQ.

Capacity is checked two ways. From our records: a task holds its reservation on a node exactly
while it is Scheduling or Running, so each attempt's [Scheduling event, event that leaves
Running] is a reservation interval, and a sweep line sums them per node and resource. From the
tasks themselves: handler and command attempts stamp time.time() at their start and end into a
file (tests/e2e/placement_jobs.py), and those intervals are swept the same way.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import asyncpg

from shared import fsm
from shared.backlog import ROUNDS
from shared.client import SkedClient, WaitTimeout
from shared.errors import NotFound
from shared.fsm import State
from shared.models import Task
from shared.store import NodeRow, Store, Tx
from shared.store.db import Db
from tests.e2e.checks import check_all_histories
from tests.e2e.conftest import Deployment
from tests.helpers import SKED, ServiceProcess, eventually, spec

RESOURCES = ("slots", "cpu", "memory_mb", "gpu")
HOLDING = {"scheduling", "running"}
FAST_RETRY: dict[str, Any] = {"backoff_base_s": 0.05, "backoff_cap_s": 0.2}
JOBS = "tests.e2e.placement_jobs"


# -- specs -----------------------------------------------------------------------------------


def stamped(
    name: str, stamps: Path, ms: float = 1, fail_below: int = 0, **kw: Any
) -> dict[str, Any]:
    """A handler task that stamps its start and end under `stamps`."""
    args = {"dir": str(stamps), "ms": ms, "fail_below": fail_below}
    return {
        "name": name,
        "job": {"kind": "handler", "handler": f"{JOBS}:stamped", "args": args},
        **kw,
    }


def stamped_command(name: str, stamps: Path, body: str, **kw: Any) -> dict[str, Any]:
    """A command task that stamps like `stamped` around the shell snippet `body`; it exits
    with the status of `body`. Killed mid-body (a timeout), it leaves no end stamp."""
    stamp = '"$1/$SKED_TASK_ID"'
    script = (
        f'echo "start $SKED_ATTEMPT $(date +%s.%N)" >> {stamp}; {body}; rc=$?; '
        f'echo "end $SKED_ATTEMPT $(date +%s.%N)" >> {stamp}; exit $rc'
    )
    return {
        "name": name,
        "job": {"kind": "command", "argv": ["sh", "-c", script, "sh", str(stamps)]},
        **kw,
    }


# -- what held what, when ----------------------------------------------------------------------


@dataclass(frozen=True)
class Hold:
    """One attempt holding its need on a node over [start, end] (epoch seconds)."""

    task_id: UUID
    attempt: int
    node: str
    start: float
    end: float
    need: dict[str, float]


def need_of(task: Task) -> dict[str, float]:
    return {"slots": 1, "cpu": task.cpu, "memory_mb": task.memory_mb, "gpu": task.gpu}


async def reservations(pool: asyncpg.Pool, tasks: dict[UUID, Task]) -> dict[tuple[UUID, int], Hold]:
    """Every attempt's reservation from the recorded history: from its Scheduling event to the
    event that moves it out of Scheduling / Running. The node is the one its Running event
    names ("started on NODE")."""
    rows = await pool.fetch(
        "SELECT task_id, from_status, to_status, attempt, reason, at FROM task_events "
        "ORDER BY task_id, version"
    )
    holds: dict[tuple[UUID, int], Hold] = {}
    opened: dict[UUID, tuple[int, float, str | None]] = {}
    for row in rows:
        task_id, to = row["task_id"], row["to_status"]
        at = row["at"].timestamp()
        if to == "scheduling":
            assert task_id not in opened, f"{task_id}: Scheduling while holding: {row}"
            opened[task_id] = (row["attempt"], at, None)
        elif to == "running":
            attempt, start, _ = opened[task_id]
            reason = row["reason"]
            assert reason.startswith("started on "), reason
            opened[task_id] = (attempt, start, reason.removeprefix("started on "))
        elif row["from_status"] in HOLDING:
            attempt, start, node = opened.pop(task_id)
            assert node is not None, f"{task_id} attempt {attempt} left Scheduling unstarted"
            holds[(task_id, attempt)] = Hold(
                task_id, attempt, node, start, at, need_of(tasks[task_id])
            )
    assert not opened, f"reservations never released: {opened}"
    return holds


def read_stamps(stamps: Path, task_id: UUID) -> dict[int, dict[str, float]]:
    """{attempt: {"start": t, "end": t}} as the task's attempts wrote them."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    path = stamps / str(task_id)
    for line in path.read_text().splitlines() if path.exists() else []:
        what, attempt, at = line.split()
        assert what not in out[int(attempt)], f"{task_id} attempt {attempt} stamped {what} twice"
        out[int(attempt)][what] = float(at)
    return dict(out)


def runs(stamps: Path, held: dict[tuple[UUID, int], Hold]) -> list[Hold]:
    """Every attempt's run as the task stamped it, on the node its reservation names.

    An attempt killed mid-run (a timeout) has no end stamp: it ran at most until the event that
    recorded its end, which is written after the kill. Each stamped run must lie inside its
    reservation: a task never runs without one."""
    out = []
    for key, hold in held.items():
        stamp = read_stamps(stamps, hold.task_id).get(hold.attempt)
        assert stamp, f"attempt {key} held {hold.node} but never started"
        assert "start" in stamp, f"attempt {key} held {hold.node} but never started"
        end = stamp.get("end", hold.end)
        assert hold.start <= stamp["start"] <= end <= hold.end, (
            f"attempt {key} ran outside its reservation: ran {stamp}, held {hold}"
        )
        out.append(Hold(hold.task_id, hold.attempt, hold.node, stamp["start"], end, hold.need))
    return out


def peak_usage(holds: Iterable[Hold]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per node and resource: the most held at any one instant, and that instant.

    A sweep line over the start and end points; at one instant releases count before
    reservations, as with max_overlap (the records are causally ordered: a scheduler reserves a
    slot only after reading the commit that released it)."""
    points: dict[str, list[tuple[float, int, dict[str, float]]]] = defaultdict(list)
    for h in holds:
        points[h.node] += [(h.start, 1, h.need), (h.end, -1, h.need)]
    peaks: dict[str, dict[str, tuple[float, float]]] = {}
    for node, pts in points.items():
        pts.sort(key=lambda p: (p[0], p[1]))
        now = dict.fromkeys(RESOURCES, 0.0)
        best = dict.fromkeys(RESOURCES, (0.0, 0.0))
        for at, sign, need in pts:
            for r in RESOURCES:
                now[r] += sign * need[r]
                if now[r] > best[r][0] + 1e-9:
                    best[r] = (now[r], at)
        peaks[node] = best
    return peaks


def capacity(row: NodeRow, resource: str, what: str) -> float:
    """A node's capacity for `resource`. Runs: its slots. Reservations also count dispatches
    held in its backlog, Scheduling, slot-free: up to ROUNDS times its slots (the default
    backlog, shared/backlog.py); cpu, memory and gpu are reserved for them as for any attempt."""
    if resource == "slots" and what == "reservations":
        return float(row.slots * (1 + ROUNDS))
    return float(getattr(row, resource))


def over_capacity(holds: list[Hold], nodes: dict[str, NodeRow], what: str) -> list[str]:
    """Each node and resource whose peak exceeds the node's capacity, with the holds open at
    that instant (the evidence); prints every peak."""
    peaks = peak_usage(holds)
    over = []
    for node, best in sorted(peaks.items()):
        row = nodes[node]
        for r in RESOURCES:
            peak, at = best[r]
            if peak > capacity(row, r, what) + 1e-6:
                open_then = sorted(
                    (h for h in holds if h.node == node and h.start <= at < h.end and h.need[r]),
                    key=lambda h: h.start,
                )
                shown = "; ".join(
                    f"{str(h.task_id)[:8]}/{h.attempt} [{h.start:.6f}, {h.end:.6f}] "
                    f"{r}={h.need[r]:g}"
                    for h in open_then
                )
                over.append(
                    f"{what}: {node} {r} {peak:g} > {capacity(row, r, what):g} at {at:.6f}: {shown}"
                )
        shown = ", ".join(f"{r} {best[r][0]:g}/{capacity(row, r, what):g}" for r in RESOURCES)
        print(f"{what}: {node} peak {shown}")  # noqa: T201 - shown with -s
    return over


class Overcommitted(AssertionError):
    """A node held or ran more than its capacity at some instant."""


def assert_within_capacity(nodes: dict[str, NodeRow], **holds: list[Hold]) -> None:
    """No node over any capacity at any instant, for each named set of holds."""
    over = [line for what, hs in holds.items() for line in over_capacity(hs, nodes, what)]
    if over:
        raise Overcommitted("a node went over its capacity:\n" + "\n".join(over))


async def node_rows(pool: asyncpg.Pool) -> dict[str, NodeRow]:
    return {n.id: n for n in await Tx(Db(pool, 0.5), 10.0).nodes.all()}


async def sked(env: dict[str, str], *args: str) -> str:
    """Run the `sked` command line as a user would; returns its output (it must exit 0)."""
    proc = await asyncio.create_subprocess_exec(
        SKED,
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, f"sked {' '.join(args)} exited {proc.returncode}: {err.decode()}"
    return out.decode()


async def assert_all_released(env: dict[str, str], pool: asyncpg.Pool, nodes: set[str]) -> None:
    """Every node's usage is back to zero, as `sked nodes --json` and the node repo report it."""
    listed = json.loads(await sked(env, "nodes", "--json"))
    assert {n["id"] for n in listed} == nodes
    for n in listed:
        used = [n["used_slots"], n["used_cpu"], n["used_memory_mb"], n["used_gpu"]]
        assert used == [0, 0, 0, 0], f"{n['id']} still holds {used}: {n}"
    for row in (await node_rows(pool)).values():
        usage = (row.used_slots, row.used_cpu, row.used_memory_mb, row.used_gpu)
        assert usage == (0, 0, 0, 0), f"{row.id} still holds {usage}"
    holding = await pool.fetchval(
        "SELECT count(*) FROM tasks WHERE status IN ('scheduling', 'running')"
    )
    assert holding == 0


def assert_overlapped(holds: list[Hold]) -> None:
    """The runs overlapped: otherwise the capacity checks would prove nothing."""
    slots = {node: best["slots"][0] for node, best in peak_usage(holds).items()}
    assert max(slots.values()) >= 2, f"no two runs overlapped on any node: {slots}"


# -- 1. many tasks with mixed needs on nodes of different sizes ------------------------------

NODES = {
    "small": ("4", "--cpu", "2", "--memory", "2048"),
    "gpu": ("6", "--cpu", "4", "--memory", "8192", "--gpu", "2"),
    "eu": ("8", "--cpu", "8", "--memory", "16384", "--label", "zone=eu"),
}

# kind: (how many, resources, selector)
MIX: dict[str, tuple[int, dict[str, Any], dict[str, str]]] = {
    "plain": (900, {}, {}),
    "light": (300, {"cpu": 0.5, "memory_mb": 256}, {}),
    "heavy": (250, {"cpu": 2, "memory_mb": 2048}, {}),
    "big": (100, {"cpu": 4, "memory_mb": 6144}, {}),  # too big for `small`
    "gpu1": (150, {"gpu": 1, "cpu": 1, "memory_mb": 1024}, {}),
    "gpu2": (50, {"gpu": 2, "cpu": 2}, {}),
    "eu": (150, {"cpu": 2, "memory_mb": 4096}, {"zone": "eu"}),
    "eu-plain": (100, {}, {"zone": "eu"}),
}


async def test_mixed_requirements_on_nodes_of_different_sizes(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    service_env: dict[str, str],
    tmp_path: Path,
) -> None:
    for _ in range(2):
        await deployment.start("scheduler")
    await deployment.start("relay")
    for node, (slots, *flags) in NODES.items():
        await deployment.executor(node, int(slots), *flags)
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    rng = random.Random(2000)
    specs = [
        stamped(f"{kind}-{i}", stamps, ms=rng.uniform(1, 5), resources=res, selector=sel)
        for kind, (n, res, sel) in MIX.items()
        for i in range(n)
    ]
    assert len(specs) == 2000
    rng.shuffle(specs)
    began = time.monotonic()
    ids = await client.submit_many(specs)
    done = await client.wait_all(ids, timeout=120)
    print(f"2,000 mixed tasks done in {time.monotonic() - began:.1f} s")  # noqa: T201

    bad = [t for t in done.values() if t.status is not State.SUCCESS]
    assert not bad, bad[:3]
    events = await check_all_histories(pool)
    picks = [
        (task_id, e["from_status"], e["attempt"])
        for task_id, evs in events.items()
        for e in evs
        if e["to_status"] == "scheduling"
    ]
    per_task = Counter(task_id for task_id, _, _ in picks)
    assert set(per_task) == set(done)
    assert set(per_task.values()) == {1}, "a task was picked twice"
    assert {(source, attempt) for _, source, attempt in picks} == {("ready", 1)}
    assert all(t.attempt == 1 for t in done.values())

    kind = {t.id: t.name.rsplit("-", 1)[0] for t in done.values()}
    where: dict[str, Counter[str | None]] = defaultdict(Counter)
    for t in done.values():
        where[kind[t.id]][t.node] += 1
    print(f"placement: { {k: dict(v) for k, v in where.items()} }")  # noqa: T201
    assert set(where["gpu1"]) == set(where["gpu2"]) == {"gpu"}, "a GPU task ran off the gpu node"
    assert set(where["eu"]) == set(where["eu-plain"]) == {"eu"}, "a zone=eu task ran off `eu`"
    assert "small" not in where["big"], "a task bigger than `small` ran on it"
    assert set(where["plain"]) == set(NODES), "plain tasks did not spread over every node"

    nodes = await node_rows(pool)
    held = await reservations(pool, done)
    assert set(held) == {(task_id, 1) for task_id in done}
    ran = runs(stamps, held)
    assert_overlapped(ran)
    await assert_all_released(service_env, pool, set(NODES))
    # last, so that the checks above still fail this test as failures rather than as the
    assert_within_capacity(nodes, reservations=list(held.values()), runs=ran)


# -- 2. a task no node can take waits, says why, and runs when a fitting node joins ----------


async def holds_for(seconds: float, probe: Callable[[], Awaitable[bool]], what: str) -> None:
    """`probe` stays true for `seconds` (checked every 100 ms): the opposite of eventually."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert await probe(), f"{what} stopped holding"
        await asyncio.sleep(0.1)


def ready_logged_at(proc: ServiceProcess) -> float:
    """When the executor logged its "ready:" line (epoch seconds, from the line's timestamp)."""
    line = next(x for x in proc.log().splitlines() if " ready: " in x)
    # asctime is local time: astimezone() on the naive value reads it as such
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp()


async def test_a_task_no_node_can_take_waits_with_its_reason_then_runs_when_a_fitting_node_joins(
    deployment: Deployment,
    client: SkedClient,
    service_env: dict[str, str],
    tmp_path: Path,
) -> None:
    # No timer may place the tasks within the second measured below: only the NOTIFY of the
    # node's registration can (the dispatch loop's fallback timer is SKED_RECONCILE_S).
    await deployment.start("scheduler", env={"SKED_RECONCILE_S": "60"})
    await deployment.executor("small", 4, "--cpu", "2", "--memory", "2048")
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    gpu_task, eu_task = await client.submit_many(
        [
            stamped("needs-2-gpus", stamps, resources={"gpu": 2}),
            stamped("needs-zone-eu", stamps, selector={"zone": "eu"}),
        ]
    )
    reasons = {gpu_task: "no node has gpu >= 2", eu_task: "no node matches selector zone=eu"}

    async def waiting_with_reasons() -> bool:
        try:
            tasks = [await client.get(i) for i in reasons]
        except NotFound:  # the submission is not taken in yet
            return False
        return all(
            t.status is State.READY and t.node is None and t.status_reason == reasons[t.id]
            for t in tasks
        )

    await eventually(waiting_with_reasons, timeout=10, what="both tasks to wait with a reason")
    await holds_for(2.0, waiting_with_reasons, "both tasks waiting with their reasons")
    # the small node works meanwhile: waiting tasks do not stop the rest
    plain = await client.submit(stamped("plain", stamps))
    assert (await client.wait(plain, timeout=10)).node == "small"
    for task_id, reason in reasons.items():
        status = await sked(service_env, "status", str(task_id))
        assert "status:    Ready" in status, status
        assert f"reason:    {reason}" in status, status
    assert await waiting_with_reasons()

    delays = {}
    for task_id, node, flags in (
        (gpu_task, "gpu-node", ("--gpu", "2")),
        (eu_task, "eu-node", ("--label", "zone=eu")),
    ):
        proc = await deployment.executor(node, 2, *flags)
        ready_at = ready_logged_at(proc)
        task = await client.wait(task_id, timeout=10)
        assert (task.status, task.node) == (State.SUCCESS, node), task
        assert task.started_at is not None
        delays[node] = task.started_at.timestamp() - ready_at
        print(f"{node}: ready -> {task.name} started in {delays[node]:.3f} s")  # noqa: T201
        if task_id == gpu_task:  # the gpu node is no place for the zone=eu task
            eu = await client.get(eu_task)
            assert (eu.status, eu.status_reason) == (State.READY, reasons[eu_task]), eu
    assert all(d < 1.0 for d in delays.values()), f"placed too late after joining: {delays}"


# -- 3. reservations are released however an attempt ends ------------------------------------

# cycled over the tasks of each kind; gpu tasks fit only r1
NEEDS: list[dict[str, Any]] = [
    {},
    {"cpu": 1, "memory_mb": 512},
    {"cpu": 2, "memory_mb": 1024},
    {"gpu": 1, "cpu": 0.5},
]


async def test_reservations_are_released_whatever_the_outcome(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    service_env: dict[str, str],
    tmp_path: Path,
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("r1", 3, "--cpu", "2", "--memory", "2048", "--gpu", "1")
    await deployment.executor("r2", 5, "--cpu", "4", "--memory", "4096")
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    kinds: dict[str, tuple[int, Callable[[str, dict[str, Any]], dict[str, Any]]]] = {
        "h-ok": (60, lambda n, r: stamped(n, stamps, ms=3, resources=r)),
        "h-fail": (
            30,
            lambda n, r: stamped(
                n, stamps, ms=2, fail_below=99, max_retries=2, resources=r, **FAST_RETRY
            ),
        ),
        "h-flaky": (
            20,
            lambda n, r: stamped(
                n, stamps, ms=2, fail_below=2, max_retries=2, resources=r, **FAST_RETRY
            ),
        ),
        "h-timeout": (
            6,
            lambda n, r: stamped(
                n, stamps, ms=30_000, timeout_s=0.3, max_retries=1, resources=r, **FAST_RETRY
            ),
        ),
        "c-ok": (30, lambda n, r: stamped_command(n, stamps, "sleep 0.003", resources=r)),
        "c-exit": (
            30,
            lambda n, r: stamped_command(
                n, stamps, "exit 3", max_retries=1, resources=r, **FAST_RETRY
            ),
        ),
        "c-timeout": (
            6,
            lambda n, r: stamped_command(
                n, stamps, "sleep 30", timeout_s=0.3, max_retries=1, resources=r, **FAST_RETRY
            ),
        ),
    }
    specs = [
        make(f"{kind}-{i}", NEEDS[i % len(NEEDS)])
        for kind, (n, make) in kinds.items()
        for i in range(n)
    ]
    random.Random(3).shuffle(specs)
    ids = await client.submit_many(specs)
    done = await client.wait_all(ids, timeout=120)

    expect = {
        "h-ok": (State.SUCCESS, 1),
        "h-fail": (State.FAILED, 3),
        "h-flaky": (State.SUCCESS, 2),
        "h-timeout": (State.TIMED_OUT, 2),
        "c-ok": (State.SUCCESS, 1),
        "c-exit": (State.FAILED, 2),
        "c-timeout": (State.TIMED_OUT, 2),
    }
    for t in done.values():
        kind = t.name.rsplit("-", 1)[0]
        assert (t.status, t.attempt, t.retry_count) == (*expect[kind], expect[kind][1] - 1), t
        if kind == "c-exit":
            assert t.error == "exit code 3", t
    await check_all_histories(pool)

    nodes = await node_rows(pool)
    held = await reservations(pool, done)
    assert set(held) == {(t.id, a) for t in done.values() for a in range(1, t.attempt + 1)}
    assert {h.node for h in held.values() if h.need["gpu"]} == {"r1"}, "a gpu attempt off r1"
    ran = runs(stamps, held)
    assert_overlapped(ran)
    await assert_all_released(service_env, pool, {"r1", "r2"})
    assert_within_capacity(nodes, reservations=list(held.values()), runs=ran)


# -- 4. tasks no node can take do not hold up those a node can -------------------------------


async def test_tasks_no_node_can_take_do_not_block_tasks_that_fit(
    deployment: Deployment, client: SkedClient, tmp_path: Path
) -> None:
    await deployment.start("scheduler")
    await deployment.executor("two", 2, "--cpu", "2", "--memory", "2048")
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    stuck = await client.submit_many(
        [stamped(f"needs-gpu-{i}", stamps, resources={"gpu": 1}) for i in range(2)]
    )

    async def waiting() -> bool:
        try:
            tasks = [await client.get(i) for i in stuck]
        except NotFound:
            return False
        return all(t.status_reason == "no node has gpu >= 1" for t in tasks)

    await eventually(waiting, timeout=10, what="the gpu tasks to wait with their reason")
    plain = await client.submit(stamped("plain", stamps))
    try:
        # longer than SKED_RECONCILE_S (5 s): the timer's passes do not help either
        task = await client.wait(plain, timeout=7)
    except WaitTimeout:
        late = await client.get(plain)
        assert (late.status, late.node) == (State.READY, None), late  # queued, never placed
        raise
    assert (task.status, task.node) == (State.SUCCESS, "two")


# -- 5. the race behind the overcommit, step by step ----------------------------------------


async def test_a_placement_that_waited_for_the_node_locks_sees_the_reservations_made_meanwhile(
    pool: asyncpg.Pool, store: Store
) -> None:
    """Two placements, as two schedulers run them: A holds the node locks and reserves the
    node's only slot; B asks for the locks meanwhile and waits; A commits. B must then see A's
    reservation, or it places a second task in the slot."""
    await store.nodes.register("n", 1, 1.0, 1024, 0, {}, uuid4())
    [(task, _)] = await store.tasks.admit_many([spec("t")], [uuid4()], (State.PENDING, State.READY))
    async with pool.acquire() as a, pool.acquire() as b:
        async with a.transaction():
            tx_a, tx_b = Tx(Db(a, 0.5), 10.0), Tx(Db(b, 0.5), 10.0)
            [seen_by_a], _ = await tx_a.nodes.lock_and_read()
            assert seen_by_a.used_slots == 0
            [moved] = await tx_a.tasks.transition_many([fsm.plan(task, State.SCHEDULING, node="n")])
            assert moved.node == "n"
            b_tx = b.transaction()
            await b_tx.start()
            b_read = asyncio.ensure_future(tx_b.nodes.lock_and_read())

            async def b_waits_for_the_locks() -> bool:
                return bool(
                    await pool.fetchval(
                        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
                        b.get_server_pid(),
                    )
                )

            await eventually(b_waits_for_the_locks, timeout=10, what="B to wait for the locks")
        try:
            [seen_by_b], _ = await asyncio.wait_for(b_read, timeout=10)
        finally:
            await b_tx.rollback()
    fresh = (await node_rows(pool))["n"]
    assert fresh.used_slots == 1
    if seen_by_b.used_slots != 1:
        raise Overcommitted(
            f"B read node n with {seen_by_b.used_slots} of its 1 slot used after A's commit "
            f"(a fresh read says {fresh.used_slots}): B would place a second task in it"
        )
