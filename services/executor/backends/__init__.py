"""What an executor runs attempts on: the Backend protocol, and what goes in and comes out.

The executor claims an attempt in Postgres, then hands it to its backend (`run`), renews the
attempt's lease through it while Postgres renews it (`renew`), asks it how the attempt stands
when the heartbeat-monitor probes (`running`, `frozen`), and stops it when the task moves on
(`stop_task`). The local backend runs processes on this machine (`backends.local`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from uuid import UUID

from shared import jsonvalue
from shared.models import CommandJob, HandlerJob, Resources

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
    node: str | None = None  # the node placement chose (a backend serving several needs it)
    resources: Resources | None = None  # what the task asked for (a cluster enforces it)
    # which task of this id: its row's created_at. A key freed by retention names a new task
    # of the same id, whose attempt 1 a cluster must not take the old attempt 1's Job for
    incarnation: str | None = None


@dataclass(frozen=True)
class Outcome:
    ok: bool  # exit code 0, or the handler returned normally
    result: Any  # handler: its JSON value; command: {"exit_code": n[, "output": declared]}
    error: str | None  # one line
    timed_out: bool
    stopped: bool  # ended by stop_task() or close()
    log_tail: str  # the end of the attempt's combined stdout and stderr
    lost: bool = False  # it ended without an exit of its own (evicted, its node or Job gone)
    unstarted: bool = False  # it never started (launch failure): no retry is spent on it
    final: bool = False  # a failure no retry can mend (an image that does not exist)

    @classmethod
    def failed(
        cls, error: str, log_tail: str = "", *, timed_out: bool = False, final: bool = False
    ) -> Outcome:
        return cls(False, None, error, timed_out, False, log_tail, final=final)

    @classmethod
    def launch_failed(cls, error: str, *, final: bool = False) -> Outcome:
        return cls(False, None, error, False, False, "", unstarted=not final, final=final)

    @classmethod
    def gone(cls, error: str, log_tail: str = "") -> Outcome:
        return cls(False, None, error, False, False, log_tail, lost=True)

    @classmethod
    def halted(cls, log_tail: str = "") -> Outcome:
        return cls(False, None, "stopped", False, True, log_tail)


def with_declared(outcome: Outcome, data: bytes, where: str) -> Outcome:
    """A command that exited 0 and declared output (`data`, read from `where`: a file, a
    termination message) gets it in its result, and downstream. Nothing declared (empty)
    leaves the outcome as it is; what sked would refuse from a producer (not JSON, NaN,
    nesting past MAX_DEPTH, a NUL) fails the attempt, saying what and where it was read."""
    if not outcome.ok or not data:
        return outcome
    try:
        output = jsonvalue.parse(data)
    except jsonvalue.Unsafe as exc:
        error = f"declared output in {where} is not JSON sked takes: {exc}"
        return Outcome.failed(error, outcome.log_tail)
    return replace(outcome, result={**outcome.result, "output": output})


@dataclass(frozen=True)
class NodeOffer:
    """A node a backend runs attempts on, as placement sees it."""

    id: str
    slots: int
    cpu: float
    memory_mb: int
    gpu: int
    labels: Mapping[str, str]
    ready: bool
    hostname: str = ""  # Kubernetes: the node's kubernetes.io/hostname label, to pin Jobs
    prefetch: int = 0  # dispatches held beyond the slots (a local node's SKED_PREFETCH)


class Backend(Protocol):
    """Runs attempts for one executor. `run` never raises for the task's own failures."""

    reaped: list[Key]  # attempts a previous executor left running, killed by start()
    # its attempts run on without this executor (a cluster's Jobs): a draining executor
    # leaves them to be adopted rather than stopping them
    detached: bool

    @property
    def offers_changed(self) -> asyncio.Event:
        """Set when offers() may have changed."""
        ...

    def offers(self) -> Mapping[str, NodeOffer] | None:
        """The nodes this backend runs attempts on; None: one node, as configured."""
        ...

    async def start(self) -> None: ...
    async def run(self, launch: Launch) -> Outcome: ...
    async def stop_task(self, task_id: UUID, attempt: int) -> bool: ...
    def adoptable(self) -> set[Key]:
        """Attempts this backend can follow though this executor did not start them (a
        cluster's Jobs run on without their executor); local processes cannot be."""
        ...

    async def follow(self, key: Key, timeout_s: float | None) -> Outcome:
        """Follow an adopted attempt (one of `adoptable()`) to its outcome."""
        ...

    async def discard(self, keys: set[Key]) -> None:
        """Stop these attempts, not followed here, whose task moved on (a cluster's Jobs left
        behind by an executor that was down when its tasks were canceled or retried)."""
        ...

    def running(self) -> set[Key]: ...
    def renew(self, key: Key, seconds: float) -> None: ...
    def frozen(self, key: Key) -> bool: ...
    async def log_tail(self, key: Key, limit: int) -> str | None:
        """The end of a running attempt's log as it is now (None: not known here)."""
        ...

    async def prune(self, older_than_s: float, keep: AbstractSet[Key]) -> int:
        """Delete what ended attempts left on this node (their log files) that was last
        written `older_than_s` ago or longer, but never an attempt's in `keep`: retention
        (SKED_RETENTION_DAYS). Returns how many were deleted."""
        ...

    async def watch(self) -> None: ...  # raises when the backend as a whole has failed
    async def close(self) -> None: ...


class OneNode:
    """The part of a Backend whose attempts are processes of this executor's one node: it
    offers that node as configured, and a process is followed only by the executor that
    started it (nothing to adopt)."""

    detached = False

    @property
    def offers_changed(self) -> asyncio.Event:
        """Never set: the one node does not change (an event per backend: events bind to
        the loop that first waits on them)."""
        event: asyncio.Event | None = self.__dict__.get("_offers_changed")
        if event is None:
            event = self.__dict__["_offers_changed"] = asyncio.Event()
        return event

    def offers(self) -> None:
        return None  # one node: the executor's own (SKED_NODE_ID, SKED_SLOTS, ...)

    def adoptable(self) -> set[Key]:
        return set()

    async def follow(self, key: Key, timeout_s: float | None) -> Outcome:
        return Outcome.gone("a local process cannot be adopted")

    async def discard(self, keys: set[Key]) -> None:
        return None  # what a previous executor left is reaped from its records at start

    async def prune(self, older_than_s: float, keep: AbstractSet[Key]) -> int:
        return 0  # nothing kept on the node (a backend that keeps logs says otherwise)
