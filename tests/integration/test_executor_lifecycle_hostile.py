"""The executor's own lifecycle on the local backend under hostile timing: drain on SIGTERM,
restart after SIGKILL, the dispatch consumer and the lease renewal loop. These cases were
found by an adversarial review; each docstring says what the code did then."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse
from uuid import uuid4

import asyncpg
import pytest

from services.executor.backends.local import LocalBackend
from services.executor.node import Attempt, items_of
from services.executor.service import Executor
from shared import fsm
from shared.bus import DISPATCH_EXCHANGE, AmqpBus, Outgoing
from shared.fsm import State
from shared.models import Dispatch, Task
from shared.settings import Settings
from shared.store import Store
from shared.wiring import backends
from tests.fakes import StubMessage
from tests.helpers import eventually, spec


@contextlib.asynccontextmanager
async def running_executor(
    settings: Settings, state: Path, node: str = "n1", slots: int = 2, **kw: Any
) -> AsyncIterator[Executor]:
    """A whole executor (its loops running) of `node` on the local backend."""
    s = settings.model_copy(update={"node_id": node, "slots": slots, **kw})
    async with backends(s) as b:
        executor = Executor(
            s, b.store, b.bus, LocalBackend(slots, state, warm_workers=0), b.ready_queue
        )
        run = asyncio.create_task(executor.run())
        try:
            await asyncio.wait_for(
                asyncio.wait(
                    [run, asyncio.ensure_future(executor.ready.wait())],
                    return_when=asyncio.FIRST_COMPLETED,
                ),
                30,
            )
            if run.done():
                run.result()
            executor._run_task = run  # type: ignore[attr-defined]
            yield executor
        finally:
            executor.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run, 60)


async def scheduled(store: Store, node: str = "n1", **kw: Any) -> Task:
    task = await store.tasks.create(spec(kw.pop("name", "probe"), **kw))
    for target in (State.PENDING, State.READY):
        task = await fsm.apply(store.tasks, task, target)
    placed: Task = await fsm.apply(store.tasks, task, State.SCHEDULING, node=node)
    return placed


async def dispatch(settings: Settings, *tasks: Task, node: str = "n1") -> None:
    bus = AmqpBus(settings.rabbitmq_url)
    await bus.connect()
    try:
        await bus.publish(
            DISPATCH_EXCHANGE,
            [Outgoing(node, Dispatch.of(t, node).model_dump_json().encode()) for t in tasks],
        )
    finally:
        await bus.close()


def sh(script: str) -> dict[str, Any]:
    return {"kind": "command", "argv": ["sh", "-c", script]}


async def status(pool: asyncpg.Pool, task: Task) -> tuple[str, int]:
    row = await pool.fetchrow("SELECT status, attempt FROM tasks WHERE id = $1", task.id)
    return row["status"], row["attempt"]


async def test_a_drain_keeps_renewing_the_leases_of_what_it_lets_finish(
    settings: Settings, store: Store, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """SIGTERM drains: "let what runs finish (bounded)" by SKED_SHUTDOWN_GRACE_S. The lease
    renewal loop used to end with `stopping`, so an attempt whose heartbeat timeout was
    shorter than the grace was frozen by its own shim mid-drain and could never finish: a 3 s
    task with a 1.5 s lease, stopped 0.5 s in, was killed at the end of the grace and failed
    ("stopped") instead of succeeding within it."""
    task = await scheduled(store, job=sh("sleep 3"), heartbeat_timeout_s=1.5, max_retries=0)
    async with running_executor(settings, tmp_path, shutdown_grace_s=8.0) as ex:
        await dispatch(settings, task)
        await eventually(lambda: _is(pool, task, "running"), timeout=20, what="running")
        await asyncio.sleep(0.5)
        ex.stop()
        await asyncio.wait_for(ex._run_task, 30)  # type: ignore[attr-defined]
    row = await pool.fetchrow("SELECT status, error FROM tasks WHERE id = $1", task.id)
    assert (row["status"], row["error"]) == ("success", None)


async def test_a_cancel_during_a_drain_stops_its_attempt(
    settings: Settings, store: Store, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """The watch loop also ended with `stopping`: an attempt canceled while the executor
    drained ran on until the end of the grace (here 20 s), its task Canceled meanwhile. Now a
    renewal refused during the drain stops it."""
    task = await scheduled(store, job=sh("sleep 30"), heartbeat_timeout_s=2.0)
    async with running_executor(settings, tmp_path, shutdown_grace_s=20.0) as ex:
        await dispatch(settings, task)
        await eventually(lambda: _is(pool, task, "running"), timeout=20, what="running")
        began = asyncio.get_running_loop().time()
        ex.stop()
        await asyncio.sleep(0.3)
        current = await store.tasks.get(task.id)
        await fsm.apply(store.tasks, current, State.CANCELED)
        await asyncio.wait_for(ex._run_task, 40)  # type: ignore[attr-defined]
        took = asyncio.get_running_loop().time() - began
    assert took < 5, f"the drain took {took:.1f} s"


async def _is(pool: asyncpg.Pool, task: Task, want: str) -> bool:
    return (await status(pool, task))[0] == want


async def running_here(executor: Executor, n: int, **kw: Any) -> list[Task]:
    """`n` tasks Running on n1 under this executor's lease, known to it as its attempts."""
    out = []
    for i in range(n):
        task = await scheduled(executor.store, name=f"r{i}", **kw)
        task = await fsm.apply(
            executor.store.tasks, task, State.RUNNING, lease_owner=str(executor.node.boot_id)
        )
        executor.node.active[(task.id, task.attempt)] = Attempt(task, None)
        out.append(task)
    return out


async def test_one_locked_row_does_not_stop_every_other_lease_renewal(
    executor: Executor, dsn: str, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor renews every lease it holds in one statement, which used to lock the rows
    with a plain FOR UPDATE. One task row held by another transaction (an operator's request,
    or any service frozen or cut off mid-transaction) made the whole statement wait past its
    timeout: none of the other attempts was renewed, their shims froze them, and the
    heartbeat-monitor declared every attempt on the node Lost, for one row. The held row is
    now passed over (not renewed this time, and not taken for refused: its attempt is not
    suspected), the others renewed."""
    tasks = await running_here(executor, 4, heartbeat_timeout_s=5.0)
    told: list[Any] = []
    monkeypatch.setattr(executor.node.backend, "renew", lambda k, s: told.append(k))
    holder = await asyncpg.connect(dsn)
    tx = holder.transaction()
    await tx.start()
    try:
        await holder.execute("SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE", tasks[0].id)
        await asyncio.sleep(0.05)
        try:
            renewed: int | str = await asyncio.wait_for(
                executor.watcher.renew_once(timeout=1.0), 10
            )
        except Exception as exc:  # what the renew loop would log and skip
            renewed = f"{type(exc).__name__}"
    finally:
        await tx.rollback()
        await holder.close()
        executor.watcher.close()
    # the three attempts nobody else holds are renewed, and their shims told so
    assert (renewed, sorted(map(str, told))) == (3, sorted(str((t.id, 1)) for t in tasks[1:]))


def message_of(task: Task, node: str = "n1") -> StubMessage:
    return StubMessage(Dispatch.of(task, node).model_dump_json().encode(), "n1")


async def test_an_outcome_is_written_when_a_held_dispatch_cannot_be_dead_lettered(
    executor: Executor, pool: asyncpg.Pool
) -> None:
    """An attempt's outcome frees a slot, so `Finisher.finish` first takes held dispatches to
    claim in the same statement (`Starter.claimable`), checking them (`_checked`) — outside
    the `retrying` that protects the write. A held entry naming another node is dead-lettered
    there; when that publish failed (RabbitMQ away for a moment) the error left `finish`
    before the outcome was written. The finish loop was restarted without the batch: the
    attempt stayed in `node.active` for good, its lease renewed every period, its task
    Running for ever, its slot and the `claiming` count held. Now claims are dropped on any
    failure (the held items put back) and the outcome is written alone."""
    task = await scheduled(executor.store)
    assert await executor.starter.start([message_of(task)]) == 1  # type: ignore[list-item]
    await asyncio.wait(executor.node.runs, timeout=30)
    ended = executor.node.outcomes.get_nowait()
    assert ended is not None
    hostile = await scheduled(executor.store, node="n9")
    executor.starter.held.extend(items_of(message_of(hostile, "n9")))  # type: ignore[arg-type]
    await executor.node.bus.close()  # RabbitMQ gone for a moment: the dead letter cannot go out
    try:
        await asyncio.wait_for(executor.finisher.finish([ended]), 30)
        raised = None
    except Exception as exc:  # what the finish loop's supervisor would see
        raised = type(exc).__name__
    row = await status(pool, task)
    active, claiming = len(executor.node.active), executor.starter.claiming
    assert (raised, row, active, claiming) == (None, ("success", 1), 0, 0)


async def test_a_dispatch_claimed_while_the_executor_stops_is_not_left_running(
    settings: Settings, store: Store, pool: asyncpg.Pool, dsn: str, tmp_path: Path
) -> None:
    """SIGTERM while a dispatch's claim statement is in flight (here held a moment by a row
    lock another transaction keeps). The drain found no run yet, put the finisher's
    end-of-stream and returned; the claim then committed (Scheduling -> Running under this
    incarnation's lease), `_begin` started a run that the closing backend halted at once, and
    its outcome went to a finisher that was gone: the task was left Running under the lease
    of an executor that no longer existed until the heartbeat-monitor called it Lost (with
    max_retries 0: Failed without having run). Now the drain waits for the claim, and an
    attempt claimed after the stop is not started but handed back to Ready as a launch
    failure, no retry spent."""
    task = await scheduled(store, job=sh("exit 0"), max_retries=0)
    holder = await asyncpg.connect(dsn)
    try:
        async with running_executor(settings, tmp_path) as ex:
            tx = holder.transaction()
            await tx.start()
            await holder.execute("SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE", task.id)
            await dispatch(settings, task)

            async def claiming() -> bool:
                return bool(
                    await pool.fetchval(
                        "SELECT count(*) FROM pg_locks"
                        " WHERE NOT granted AND locktype = 'transactionid'"
                    )
                    > 0
                )

            await eventually(claiming, timeout=20, what="the claim waiting on the row lock")
            ex.stop()
            await asyncio.sleep(0.3)
            await tx.rollback()
            await asyncio.wait_for(ex._run_task, 30)  # type: ignore[attr-defined]
    finally:
        await holder.close()
    row = await pool.fetchrow(
        "SELECT status, retry_count, launch_failures FROM tasks WHERE id = $1", task.id
    )
    # claimed after the stop: not started, handed back as a launch failure, no retry spent
    assert dict(row) == {"status": "ready", "retry_count": 0, "launch_failures": 1}


async def test_a_duplicated_dispatch_does_not_leak_its_first_copy_unacknowledged(
    settings: Settings, store: Store, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """Consumers must drop duplicates (shared/bus.publish). A dispatch message that arrived
    again while its attempt ran took `Starter._checked`'s "same attempt again while it runs"
    branch, which made the second copy the attempt's message and forgot the first, on the
    same live channel: only the second was acknowledged with the outcome, the first stayed
    unacknowledged for good and held one unit of the consumer's prefetch. A node of 2 slots
    (SKED_PREFETCH=0: prefetch 2) after one replay could no longer run two dispatch messages
    at once. Now the extra copy is acknowledged at once."""
    async with running_executor(settings, tmp_path, slots=2, prefetch=0):
        task = await scheduled(store, name="dup", job=sh("sleep 1"))
        await dispatch(settings, task)
        await eventually(lambda: _is(pool, task, "running"), timeout=20, what="running")
        await dispatch(settings, task)  # the same dispatch again, while it runs
        await eventually(lambda: _is(pool, task, "success"), timeout=20, what="dup ran")
        await asyncio.sleep(0.5)
        leaked = await _unacked(settings)
        a = await scheduled(store, name="a", job=sh("sleep 3"))
        b = await scheduled(store, name="b", job=sh("sleep 3"))
        await dispatch(settings, a)
        await dispatch(settings, b)

        async def both() -> bool:
            return await _is(pool, a, "running") and await _is(pool, b, "running")

        try:
            await eventually(both, timeout=2.5, what="a and b running side by side")
            side_by_side = True
        except AssertionError:
            side_by_side = False
    assert (leaked, side_by_side) == (0, True)


async def _unacked(settings: Settings) -> Any:
    """Messages of sked.node.n1 delivered and not acknowledged, as RabbitMQ counts them."""

    vhost = unquote(urlparse(settings.rabbitmq_url).path[1:])
    out = subprocess.run(
        [
            "rabbitmqctl",
            "-q",
            "list_queues",
            "-p",
            vhost,
            "--formatter",
            "json",
            "name",
            "messages_unacknowledged",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return {q["name"]: q["messages_unacknowledged"] for q in json.loads(out)}.get("sked.node.n1")


async def test_the_end_of_a_drain_stops_what_runs_at_once_not_one_after_another(
    settings: Settings, store: Store, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """When SKED_SHUTDOWN_GRACE_S was spent, `Executor.draining` stopped what still ran with
    `await backend.stop_task(...)` in a loop: one attempt at a time, each waiting out its
    SIGTERM -> SIGKILL grace (1 s) before the next was even sent SIGTERM. 8 attempts that
    ignore SIGTERM took 8 s more after the grace, 50 took 50 s: past what a process manager
    allows a stop (Kubernetes' 30 s). The stops now go out together: grace + about one stop
    grace."""
    slots = 8
    tasks = [
        await scheduled(store, name=f"t{i}", job=sh("trap '' TERM; sleep 60")) for i in range(slots)
    ]
    async with running_executor(settings, tmp_path, slots=slots, shutdown_grace_s=0.5) as ex:
        await dispatch(settings, *tasks)

        async def all_running() -> bool:
            return bool(
                await pool.fetchval("SELECT count(*) FROM tasks WHERE status = 'running'") == slots
            )

        await eventually(all_running, timeout=30, what="all running")
        await asyncio.sleep(0.5)
        began = asyncio.get_running_loop().time()
        ex.stop()
        await asyncio.wait_for(ex._run_task, 60)  # type: ignore[attr-defined]
        took = asyncio.get_running_loop().time() - began
    assert took < 0.5 + 1.0 + 1.5, f"the drain took {took:.1f} s"


async def test_an_attempt_its_dead_executor_left_is_lost_at_once_on_restart(
    settings: Settings, store: Store, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """An executor killed with SIGKILL (its warden too) leaves its attempts Running under its
    lease; the next executor on the node's state directory kills what they left (the local
    backend's records: `reaped`) and knew them dead, but said nothing: each task stayed
    Running a whole heartbeat timeout (here 60 s) until the heartbeat-monitor's ladder called
    it Lost. It is now Lost at once (its lease taken over first), its process group killed."""
    task = await scheduled(store, job=sh("sleep 60"), heartbeat_timeout_s=60.0)
    task = await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(uuid4()))
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_bytes()
        record = {
            "pid": proc.pid,
            "pgid": proc.pid,
            "start_time": int(stat[stat.rindex(b")") + 2 :].split()[19]),
            "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        }
        (tmp_path / "running").mkdir(parents=True)
        (tmp_path / "running" / f"{task.id}-{task.attempt}.json").write_text(json.dumps(record))
        async with running_executor(settings, tmp_path):
            await eventually(lambda: _is(pool, task, "lost"), timeout=10, what="lost at once")
        assert proc.wait(timeout=10) < 0  # killed
    finally:
        proc.kill()
        proc.wait(timeout=10)
