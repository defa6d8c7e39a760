"""How an attempt's outcome becomes moves: end state, then RetryWait while retries remain (pure).

The executor applies these when its process ends; the heartbeat-monitor applies the same when
it reconciles an attempt whose heartbeats were lost but whose job the backend saw finish;
recovery uses the retry half for Lost tasks. One rule, wherever the outcome comes from.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict

from shared import fsm
from shared.backoff import retry_delay
from shared.fsm import Move, State
from shared.models import Task


class Report(BaseModel):
    """An attempt's outcome as reported (by the backend, or an executor answering a probe)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ok: bool
    result: Any = None
    error: str | None = None
    timed_out: bool = False
    log_tail: str = ""


def end_move(task: Task, report: Report, reason: str) -> Move:
    """Running (or Lost) -> Success | TimedOut | Failed, carrying result, error and log tail."""
    changes: dict[str, Any] = {"log_tail": report.log_tail, "result": report.result}
    if report.ok:
        return fsm.plan(task, State.SUCCESS, reason, **changes, error=None)
    target = State.TIMED_OUT if report.timed_out else State.FAILED
    return fsm.plan(
        task, target, f"{reason}: {report.error or target.label}", **changes, error=report.error
    )


def retry_or_fail(task: Task, now: datetime, why: str) -> Move:
    """A failed attempt's next move: RetryWait (capped exponential backoff with jitter) while
    retries remain, else Failed — or, from Failed/TimedOut with none left, nothing to do."""
    if fsm.has_retry_left(task):
        spec = task.spec
        delay = retry_delay(task.retry_count, spec.backoff_base_s, spec.backoff_cap_s)
        return fsm.plan(
            task,
            State.RETRY_WAIT,
            f"{why}: retry {task.retry_count + 1} of {task.max_retries}",
            next_retry_at=now + timedelta(seconds=delay),
        )
    return fsm.plan(task, State.FAILED, f"{why}: no retry left ({task.max_retries} allowed)")


def retries(ended: list[Task], now: datetime) -> list[Move]:
    """RetryWait moves for the Failed / TimedOut tasks among `ended` that have a retry left."""
    return [
        retry_or_fail(t, now, t.status.label)
        for t in ended
        if t.status in fsm.RETRYABLE and fsm.has_retry_left(t)
    ]
