"""A job given to a handler worker (`Ticket`), and how it ended there (`Verdict`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Verdict:
    """How a job given to a worker ended there: `answered` (`answer` is the worker's reply),
    `returned` (never started: given back, or behind the job its worker died in — run it
    elsewhere), `halted` (started, or may have, then its worker was killed — `why`:
    "stopped" or "timed out"), or `lost` (its worker died, or broke the protocol, with it; it
    may have started). `first`: the job its worker ran when it ended, whose output the
    worker's out file holds."""

    how: str
    answer: dict[str, Any] | None = None
    why: str = ""
    first: bool = False


def ran_for(answer: dict[str, Any] | None, ticket: Ticket) -> float:
    """How long an answered job ran: as its worker said ("ran"), or else as seen from here,
    from when it became its worker's first job (which counts the worker's wake-up too)."""
    ran = answer.get("ran") if answer else None
    if isinstance(ran, float) and 0.0 <= ran < 1e6:
        return ran
    if ticket.head_at is None:
        return 0.0
    return asyncio.get_running_loop().time() - ticket.head_at


class Ticket:
    """A job given to a worker, until its verdict."""

    __slots__ = ("done", "head_at", "stem", "timeout_s", "timer")

    def __init__(self, stem: str, timeout_s: float | None) -> None:
        self.stem = stem
        self.timeout_s = timeout_s
        self.done: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self.head_at: float | None = None  # loop time it became the first its worker has
        self.timer: asyncio.TimerHandle | None = None  # its run timeout, from then
