"""An attempt's outcome on its way from the task to Postgres, against what a task can make of
it: a failure reply past the line limit, sparse output of a job cut short, a large result (no
stall of the executor's event loop), a late result written twice, result keys that collide
once escaped, a live log tail full of NULs.

Handlers run in the workers as `tests.integration.test_outcome_hostile:<name>`."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import asyncpg
import pytest

from services.executor import finish
from services.executor.backends import Launch, Outcome
from services.executor.backends.local import LocalBackend
from services.executor.node import Attempt
from services.executor.service import Executor
from shared import fsm, heartbeat
from shared.fsm import State
from shared.models import HandlerJob, Task
from shared.outcome import Report
from tests.fakes import StubMessage
from tests.helpers import loop_stalls
from tests.integration.test_executor_hostile import short_jobs_backend
from tests.integration.test_executor_outcomes import running

HERE = "tests.integration.test_outcome_hostile"


# --- handlers (run in the workers) -------------------------------------------------------------


def raise_control_chars(n: int) -> None:
    """An exception whose message is `n` control characters: 1 byte each in the traceback,
    6 each (\\u0001) in the JSON of the failure reply."""
    raise ValueError("\x01" * n)


def sparse_output_then_sleep(size: int, seconds: float) -> None:
    """Make this job's output file (fd 1) `size` bytes of holes, then outlive the timeout."""
    os.ftruncate(1, size)
    time.sleep(seconds)


def big_list(n: int) -> list[int]:
    return [0] * n


# --- helpers -----------------------------------------------------------------------------------


def handler(name: str, args: Any = None, timeout_s: float | None = None) -> Launch:
    return Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}", args=args), timeout_s)


async def run(backend: LocalBackend, launch: Launch, limit: float = 60) -> Outcome:
    async with asyncio.timeout(limit):
        return await backend.run(launch)


def attempt(task: Task) -> Attempt:
    return Attempt(task, StubMessage(b""))  # type: ignore[arg-type]


async def answer_to(
    executor: Executor, monkeypatch: pytest.MonkeyPatch, task: Task, want: str
) -> heartbeat.ProbeAnswer:
    """The executor's answer to a monitor's probe (`want`) of the task's attempt."""
    replies: list[bytes] = []

    async def reply(message: Any, body: bytes) -> None:
        replies.append(body)

    monkeypatch.setattr(executor.node.bus, "reply", reply)
    probe = heartbeat.Probe.model_validate(
        {"task_id": task.id, "attempt": task.attempt, "want": want}
    )
    message = StubMessage(probe.model_dump_json().encode(), reply_to="amq.rabbitmq.reply-to")
    message.correlation_id = "c1"
    async with asyncio.timeout(30):
        await executor._on_probe(message)  # type: ignore[arg-type]
    assert len(replies) == 1, f"no answer to a probe of {want}"
    return heartbeat.ProbeAnswer.model_validate_json(replies[0])


# --- findings ----------------------------------------------------------------------------------


async def test_a_failure_reply_past_the_line_limit_is_taken_for_a_breach(
    tmp_path: Path,
) -> None:
    """A failure's reply once kept up to 8 M characters of traceback, escaped by json.dumps
    to up to 6 bytes each: an exception whose message is 3 MB of control characters made an
    18 MB reply line, taken for a protocol breach — the ValueError lost, the worker killed,
    the job behind it moved. Now the reply's traceback is cut to MAX_TRACE_CHARS (at most
    12 bytes each): the reply fits, the attempt fails with its own error, the next job runs."""
    b = await short_jobs_backend(tmp_path)
    try:
        hostile = asyncio.create_task(run(b, handler("raise_control_chars", [3_000_000])))
        add = HandlerJob(handler="tests.handlers:add", args=[1, 2])
        innocent = asyncio.create_task(run(b, Launch(uuid4(), 1, add, None)))
        bad, good = await hostile, await innocent
    finally:
        await b.close()
    assert (good.ok, good.result) == (True, 3), (good.error, bad.error)
    assert "not this job's reply" not in (bad.error or ""), bad.error
    assert (bad.error or "").startswith("ValueError"), bad.error


async def test_a_timed_out_handler_s_sparse_output_is_copied_whole_into_its_log(
    tmp_path: Path,
) -> None:
    """A handler job cut short (timeout, stop) once had its dead worker's output file copied
    whole into the attempt's log (shutil.copyfile): stdout ftruncate()d to 1 GiB of holes
    (free for the task) became 1 GiB of real blocks on the node's disk. Now the file is moved
    (`files.move_or_tail`; a hole stays a hole), or only its last 16 MiB copied."""
    size = 1 << 30
    b = LocalBackend(1, tmp_path / "state", warm_workers=0)
    await b.start()
    launch = handler("sparse_output_then_sleep", [size, 60], timeout_s=1.0)
    try:
        outcome = await run(b, launch)
    finally:
        await b.close()
    assert outcome.timed_out, outcome
    log_file = b.state_dir / "logs" / f"{launch.task_id}-{launch.attempt}.log"
    st = os.stat(log_file) if log_file.exists() else None
    written = 0 if st is None else st.st_blocks * 512
    assert written < 64 * 1024 * 1024, f"{written} bytes written to the attempt's log"


async def test_a_retried_write_records_a_late_result_twice(
    executor: Executor, pool: asyncpg.Pool
) -> None:
    """A late result (the task moved on: canceled here) is recorded in the write's
    transaction; a write retried after its COMMIT's reply was lost once recorded the same
    (task, attempt) outcome a second time. Now late_results has a unique index on (task_id,
    attempt) (migration 0021) and record_late_results skips what is there."""
    moved_on = await running(executor, "moved-on")
    await fsm.apply(executor.store.tasks, moved_on, State.CANCELED, reason="operator")
    ok = Report(ok=True, result=42)
    await executor.finisher.write([(attempt(moved_on), ok)], [])
    # the same write again, as `retrying` sends it after a lost COMMIT reply
    await executor.finisher.write([(attempt(moved_on), ok)], [])
    rows = await pool.fetch("SELECT task_id, attempt, ok FROM late_results")
    assert [(r["task_id"], r["attempt"]) for r in rows] == [(moved_on.id, 1)]


async def test_a_result_whose_keys_collide_once_cleaned_loses_a_key_silently(
    executor: Executor,
) -> None:
    """`jsonvalue.clean` escapes a NUL in a key as the two characters `\\0`: a result with
    both "k\\x00" and "k\\\\0" as keys once became an object with one key, the other's value
    dropped — a success with a result nobody made. Now `clean` refuses keys that collide once
    escaped, naming them: the attempt fails with that reason."""
    task = await running(executor, "collide")
    result = {"k\x00": 1, "k\\0": 2}
    await executor.finisher.finish([(attempt(task), Outcome(True, result, None, False, False, ""))])
    stored = await executor.store.tasks.get(task.id)
    # either both values kept, or the attempt failed saying why
    assert stored.status is State.FAILED or (
        isinstance(stored.result, dict) and sorted(stored.result.values()) == [1, 2]
    ), (stored.status, stored.result)


async def test_a_running_attempt_s_log_with_nul_bytes_gets_no_live_tail(
    executor: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sked logs` of a running attempt probes its executor (want="log"), which reads the
    last LIVE_LOG_CHARS bytes of the log and `clean_text`s them, writing each NUL as the two
    characters `\\0`: a tail holding NULs once grew past ProbeAnswer's max_length and no
    answer was sent (the client waited out its timeout). Now the cleaned tail is cut again
    to LIVE_LOG_CHARS, keeping its end."""
    task = await running(executor, "binary-log")
    backend = executor.node.backend
    assert isinstance(backend, LocalBackend)
    logs = backend.state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"{task.id}-{task.attempt}.log").write_bytes(b"progress\x00" * 20_000)
    answer = await answer_to(executor, monkeypatch, task, "log")
    assert answer.log is not None
    assert answer.log.endswith("progress\\0")


async def test_a_large_result_stalls_the_executor_s_event_loop_for_seconds(
    executor: Executor, tmp_path: Path
) -> None:
    """A handler returning [0] * 5_000_000 (15 MB of JSON, under the worker's 16 MB reply
    limit then) once reached the executor as a success, and `Finisher.finish` made it
    storable on the event loop (`jsonvalue.clean`, a Python walk of every element) before
    finding it over MAX_RESULT_BYTES: ~9 s without a lease renewed or a probe answered for
    any attempt on the node. Now the worker refuses it by its reply's bytes (it never crosses
    the pipe); `storable` judges a result's size from its JSON text before walking it (what
    a handler writing around its worker can still send, under the 4 MiB reply limit), and
    the finisher walks a result of many values (a storable megabyte of numbers) in a thread."""
    b = LocalBackend(1, tmp_path / "big", warm_workers=0)
    await b.start()
    try:
        refused = await run(b, handler("big_list", [5_000_000]))
    finally:
        await b.close()
    assert not refused.ok
    assert "result too large" in (refused.error or ""), refused
    over, under = await running(executor, "over"), await running(executor, "under")
    batch = [
        (attempt(over), Outcome(True, [0] * 1_300_000, None, False, False, "")),  # 3.9 MB
        (attempt(under), Outcome(True, [0] * 300_000, None, False, False, "")),  # 0.9 MB
    ]
    async with loop_stalls(0.02) as gaps:
        await asyncio.sleep(0.1)
        async with asyncio.timeout(120):
            await executor.finisher.finish(batch)
    assert (await executor.store.tasks.get(over.id)).status is State.FAILED  # over the limit
    stored = await executor.store.tasks.get(under.id)
    assert stored.status is State.SUCCESS
    assert stored.result == [0] * 300_000
    assert max(gaps) < 0.5, f"the event loop stalled {max(gaps):.1f} s on one result"


async def test_a_probe_of_an_unreported_large_result_walks_it_off_the_event_loop(
    executor: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A monitor's probe of an attempt that ended here but whose end is not yet written
    (`node.unreported`) is answered with the outcome made storable. `_on_probe` walked it on
    the event loop: a storable megabyte of numbers (~2 µs a value) held every lease renewal
    and probe answer of the node for over half a second, where the finisher walks it in a
    thread. Now both go through `finish.storable_report`."""
    task = await running(executor, "unreported")
    key = (task.id, task.attempt)
    executor.node.unreported[key] = Outcome(True, [0] * 300_000, None, False, False, "")
    walked_on: list[bool] = []
    real = finish.storable

    def watched(report: Report) -> Report:
        walked_on.append(threading.current_thread() is threading.main_thread())
        return real(report)

    monkeypatch.setattr(finish, "storable", watched)
    answer = await answer_to(executor, monkeypatch, task, "state")
    assert answer.state == "finished"
    assert answer.report is not None
    assert answer.report.result == [0] * 300_000
    assert walked_on == [False], "the result was walked on the event loop, or not at all"
