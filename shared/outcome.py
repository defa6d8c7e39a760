"""How an attempt's outcome becomes moves: end state, then RetryWait while retries remain (pure).

The executor applies these when its process ends; the heartbeat-monitor applies the same when
it reconciles an attempt whose heartbeats were lost but whose job the backend saw finish;
recovery uses the retry half for Lost tasks. One rule, wherever the outcome comes from; and
the one outcome of an attempt that never started in time (`not_started`).
"""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict

from shared import fsm
from shared.backoff import retry_delay
from shared.fsm import Move, State
from shared.jsonvalue import MAX_RESULT_BYTES as MAX_RESULT_BYTES  # a result's limit, here too
from shared.jsonvalue import clean, clean_text, cleaned_size_floor, clip
from shared.models import Task


class Report(BaseModel):
    """An attempt's outcome as reported (by the backend, or an executor answering a probe)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ok: bool
    result: Any = None
    error: str | None = None
    timed_out: bool = False
    log_tail: str = ""
    lost: bool = False  # ended without an exit of its own (evicted; its node or Job gone)
    unstarted: bool = False  # never started (a launch failure): no retry is spent on it
    final: bool = False  # a failure no retry can mend (an image that does not exist)


def end_move(
    task: Task,
    report: Report,
    reason: str,
    owner: UUID | None = None,
    read_back: bool = True,
    stored: bool = False,
) -> Move:
    """Running (or Lost) -> Success | TimedOut | Failed, carrying result, error and log tail.

    The report is made storable first (`storable`; `stored=True`: the caller did, ~3-11 µs
    a report): whatever an attempt printed or returned, the move can be written.
    `read_back=False`: a success's row is not read back (fsm.Move); any other end's is, as
    its retry is planned from it.
    """
    if not stored:
        report = storable(report)
    changes: dict[str, Any] = {"log_tail": report.log_tail, "result": report.result}
    if report.ok:
        return fsm.plan(task, State.SUCCESS, reason, read_back=read_back, **changes, error=None)
    target = State.TIMED_OUT if report.timed_out else State.FAILED
    why = f"{reason}: {report.error or target.label}"
    if report.lost and task.status is State.RUNNING:
        # reported by the executor that holds the attempt's lease (`owner`): it may declare
        # its own attempt lost before the lease runs out, as its backend fences the next one
        holder: dict[str, Any] = {"lease_owner": str(owner)} if owner is not None else {}
        return fsm.plan(task, State.LOST, f"{why} (lost)", **changes, **holder)
    if report.unstarted and task.status is State.RUNNING:
        if fsm.has_launch_left(task):
            spent = f"launch failure {task.launch_failures + 1} of {task.max_launch_failures}"
            return fsm.plan(task, State.READY, f"{why}: never started, {spent}; no retry spent")
        spent = f"never started, launch failures spent ({task.max_launch_failures})"
        why = f"{why}: {spent}"
        report = report.model_copy(update={"final": True, "error": f"{report.error}: {spent}"})
    if report.final:
        changes["retry_count"] = task.max_retries  # nothing a retry could mend
    return fsm.plan(task, target, why, **changes, error=report.error)


def retry_or_fail(task: Task, why: str) -> Move:
    """A failed attempt's next move: RetryWait (capped exponential backoff with jitter) while
    retries remain, else Failed — or, from Failed/TimedOut with none left, nothing to do.

    The delay travels as a duration: Postgres adds it to its own now(), so a writer whose clock
    is off changes no due time."""
    if fsm.has_retry_left(task):
        spec = task.spec
        delay = retry_delay(task.retry_count, spec.backoff_base_s, spec.backoff_cap_s)
        return fsm.plan(
            task,
            State.RETRY_WAIT,
            f"{why}: retry {task.retry_count + 1} of {task.max_retries}",
            retry_in_s=delay,
        )
    return fsm.plan(task, State.FAILED, f"{why}: no retry left ({task.max_retries} allowed)")


def not_started(task: Task) -> Move:
    """Ready or Scheduling -> Failed, final at once: the task's schedule timeout ran out before
    an attempt started. The reason is also its error, so `sked status` and `wait` show it."""
    limit = task.schedule_timeout_s
    why = "not started within " + (
        f"{limit:g} s (schedule_timeout_s)" if limit is not None else "its schedule timeout"
    )
    return fsm.plan(task, State.FAILED, why, error=why)


def retries(ended: list[Task]) -> list[Move]:
    """RetryWait moves for the Failed / TimedOut tasks among `ended` that have a retry left."""
    return [
        retry_or_fail(t, t.status.label)
        for t in ended
        if t.status in fsm.RETRYABLE and fsm.has_retry_left(t)
    ]


# -- making what an attempt produced storable --------------------------------------------------

# MAX_RESULT_BYTES (jsonvalue): a result's JSON; more fails the attempt (keep results small)
MAX_ERROR_CHARS = 2000
MAX_LOG_TAIL_CHARS = 64 * 1024


def storable(report: Report) -> Report:
    """The report as Postgres can store it. Text is cleaned and cut with a marker; a result
    that cannot be stored (NaN, Infinity, too deep, too large) fails the attempt with the
    reason: silently changing a result would hand downstream a value nobody made."""
    log_tail = clip(clean_text(report.log_tail or ""), MAX_LOG_TAIL_CHARS, keep_end=True)
    error = None if report.error is None else clip(clean_text(report.error), MAX_ERROR_CHARS)
    try:
        result = _storable_result(report.result)
    except (ValueError, RecursionError) as exc:
        why = clip(clean_text(f"result cannot be stored: {exc}"), MAX_ERROR_CHARS)
        return Report(ok=False, error=why, timed_out=report.timed_out, log_tail=log_tail)
    if result is report.result and error == report.error and log_tail == report.log_tail:
        return report  # already storable, as most are: no copy of the model
    return report.model_copy(update={"result": result, "error": error, "log_tail": log_tail})


def _storable_result(value: Any) -> Any:
    """`value` cleaned, or ValueError saying why it cannot be stored. Its size is judged
    first, from its JSON text (json.dumps: C, a hundred times the walk's speed), so that a
    result far over the limit is refused without `clean` walking each of its elements."""
    try:
        text: str | None = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = None  # not JSON as it stands: the walk says why
    if text is not None and (floor := cleaned_size_floor(text)) > MAX_RESULT_BYTES:
        size = f"{floor}" if floor == len(text) else f"at least {floor}"
        raise ValueError(f"{size} bytes of JSON, over the limit of {MAX_RESULT_BYTES}")
    result = clean(value)
    if text is None or "\\u0000" in text or "\\ud" in text:
        # what `clean` changes (a NUL, maybe a lone surrogate) is in it: measured again
        size_now = len(json.dumps(result))
        if size_now > MAX_RESULT_BYTES:
            raise ValueError(f"{size_now} bytes of JSON, over the limit of {MAX_RESULT_BYTES}")
    return result
