"""A scripted backend for tests of the executor's decisions: attempts end as the test says,
when it says (no processes). The local backend is tested against real processes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from uuid import UUID

from services.executor.backends import Key, Launch, OneNode, Outcome


class StubBackend(OneNode):
    """A Backend whose attempts end as `outcome(launch)` says, when the test lets them
    (`release`), or at once when `hold` is False. Records every launch."""

    def __init__(
        self, outcome: Callable[[Launch], Outcome] | None = None, hold: bool = False
    ) -> None:
        self.outcome = outcome or (lambda _l: Outcome(True, None, None, False, False, ""))
        self.hold = hold
        self.launched: list[Launch] = []
        self.reaped: list[Key] = []
        self._gates: dict[Key, asyncio.Event] = {}
        self._stopped: set[Key] = set()
        self.renewals: list[tuple[Key, float]] = []

    async def start(self) -> None:
        return None

    async def run(self, launch: Launch) -> Outcome:
        key = (launch.task_id, launch.attempt)
        self.launched.append(launch)
        gate = self._gates[key] = asyncio.Event()
        if not self.hold:
            gate.set()
        await gate.wait()
        del self._gates[key]
        return Outcome.halted() if key in self._stopped else self.outcome(launch)

    def release(self, key: Key) -> None:
        self._gates[key].set()

    async def stop_task(self, task_id: UUID, attempt: int) -> bool:
        key = (task_id, attempt)
        if key not in self._gates:
            return False
        self._stopped.add(key)
        self._gates[key].set()
        return True

    async def log_tail(self, key: Key, limit: int) -> str | None:
        return f"log of {key[0]} attempt {key[1]}\n"[-limit:] if key in self._gates else None

    def running(self) -> set[Key]:
        return set(self._gates)

    def renew(self, key: Key, seconds: float) -> None:
        self.renewals.append((key, seconds))

    def frozen(self, key: Key) -> bool:
        return False

    async def watch(self) -> None:
        await asyncio.Event().wait()

    async def close(self) -> None:
        return None
