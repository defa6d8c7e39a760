"""What an executor runs attempts on: the Backend protocol, and what goes in and comes out.

The executor claims an attempt in Postgres, then hands it to its backend (`run`), renews the
attempt's lease through it while Postgres renews it (`renew`), asks it how the attempt stands
when the heartbeat-monitor probes (`running`, `frozen`), and stops it when the task moves on
(`stop_task`). The local backend runs processes on this machine (`backends.local`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

from shared.models import CommandJob, HandlerJob

Key = tuple[UUID, int]  # (task id, attempt)


@dataclass(frozen=True)
class Launch:
    task_id: UUID
    attempt: int
    job: CommandJob | HandlerJob
    timeout_s: float | None  # run timeout; None = no limit
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for the task
    inputs: Any = None  # a workflow task's inputs from its upstreams (None: none)
    # seconds the attempt's lease is known to last from now (None: no lease is kept)
    lease_s: float | None = None


@dataclass(frozen=True)
class Outcome:
    ok: bool  # exit code 0, or the handler returned normally
    result: Any  # handler: its JSON value; command: {"exit_code": n[, "output": declared]}
    error: str | None  # one line
    timed_out: bool
    stopped: bool  # ended by stop_task() or close()
    log_tail: str  # the end of the attempt's combined stdout and stderr

    @classmethod
    def failed(cls, error: str, log_tail: str = "", *, timed_out: bool = False) -> Outcome:
        return cls(False, None, error, timed_out, False, log_tail)

    @classmethod
    def halted(cls, log_tail: str = "") -> Outcome:
        return cls(False, None, "stopped", False, True, log_tail)


class Backend(Protocol):
    """Runs attempts for one executor. `run` never raises for the task's own failures."""

    reaped: list[Key]  # attempts a previous executor left running, killed by start()

    async def start(self) -> None: ...
    async def run(self, launch: Launch) -> Outcome: ...
    async def stop_task(self, task_id: UUID, attempt: int) -> bool: ...
    def running(self) -> set[Key]: ...
    def renew(self, key: Key, seconds: float) -> None: ...
    def frozen(self, key: Key) -> bool: ...
    async def watch(self) -> None: ...  # raises when the backend as a whole has failed
    async def close(self) -> None: ...
