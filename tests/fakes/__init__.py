"""Fast fakes of what services talk to, for unit tests of their decisions in milliseconds:
an in-memory store (store.py), a ready queue, a bus that records, and AMQP messages. The
scripted backend is services/executor/backends/stub.py.

These are not the product: the real-server suites prove the real adapters. A fake that
drifts from them shows up as a unit test that passes where an integration test fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID, uuid4

from shared.bus import UNROUTABLE, Outgoing
from shared.outcome import Report
from shared.queues import PARKED_KEY, READY_KEY, score
from tests.fakes.store import InMemoryStore, new_task

__all__ = [
    "FakeReadyQueue",
    "InMemoryStore",
    "StubBus",
    "StubMessage",
    "new_task",
    "report",
    "submission",
]


def _now() -> datetime:
    return datetime.now(UTC)


class FakeReadyQueue:
    """shared.queues.ReadyQueue's behaviour over plain dicts: pops the lowest score."""

    def __init__(self, aging_s: float = 5.0) -> None:
        self.aging_s = aging_s
        self.sets: dict[str, dict[UUID, float]] = {READY_KEY: {}, PARKED_KEY: {}}
        self.built = True

    def _score(self, task: Any) -> float:
        return score(task.priority, task.queued_at or _now(), self.aging_s)

    score_of = _score

    async def push(self, tasks: Iterable[Any], *, back: bool = False) -> int:
        n = 0
        for task in tasks:
            if not (back and task.id in self.sets[READY_KEY]):  # back: as ZADD NX
                self.sets[READY_KEY][task.id] = self._score(task)
            n += 1
        return n

    async def pop(self, n: int) -> list[UUID]:
        return [task_id for task_id, _ in await self.pop_scored(n)]

    async def pop_scored(self, n: int) -> list[tuple[UUID, float]]:
        ready = self.sets[READY_KEY]
        out = sorted(ready, key=lambda i: ready[i])[:n]
        return [(task_id, ready.pop(task_id)) for task_id in out]

    async def remove(self, ids: Sequence[UUID]) -> None:
        for members in self.sets.values():
            for task_id in ids:
                members.pop(task_id, None)

    async def park(self, tasks: Iterable[Any], key: str = PARKED_KEY) -> int:
        parked = self.sets.setdefault(key, {})
        n = 0
        for task in tasks:
            parked[task.id] = self._score(task)
            n += 1
        return n

    async def unpark(self, key: str = PARKED_KEY) -> int:
        parked = self.sets.setdefault(key, {})
        for task_id, s in parked.items():
            self.sets[READY_KEY][task_id] = min(s, self.sets[READY_KEY].get(task_id, s))
        n = len(parked)
        parked.clear()
        return n

    async def size(self) -> int:
        return len(self.sets[READY_KEY])

    async def waiting(self) -> int | None:  # built since start: the fake never loses its data
        return len(self.sets[READY_KEY])

    def parked(self, key: str = PARKED_KEY) -> set[UUID]:
        return set(self.sets.get(key, {}))


@dataclass
class StubBus:
    """Records what is published and dead-lettered; answers requests from a script."""

    published: list[tuple[str, Outgoing]] = field(default_factory=list)
    dead: list[tuple[bytes, str]] = field(default_factory=list)
    answers: dict[str, object] = field(default_factory=dict)  # routing key -> answer
    fail_publish: BaseException | None = None

    async def publish(self, exchange: str, messages: Sequence[Outgoing]) -> None:
        if self.fail_publish is not None:
            raise self.fail_publish
        self.published.extend((exchange, m) for m in messages)

    async def publish_each(
        self, exchange: str, messages: Sequence[Outgoing], timeout: float
    ) -> list[Exception | None]:
        """As AmqpBus.publish_each, by way of `publish` (which tests override): its error
        befalls every message."""
        try:
            await self.publish(exchange, messages)
        except Exception as exc:
            return [exc for _ in messages]
        return [None for _ in messages]

    async def dead_letter(
        self, body: bytes, reason: str, routing_key: str, headers: dict[str, Any] | None = None
    ) -> None:
        self.dead.append((body, reason))

    async def request(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        timeout: float,
        correlation_id: str | None = None,
        accept: Callable[[bytes], bool] | None = None,
    ) -> object:
        answer = self.answers.get(routing_key, UNROUTABLE)
        if callable(answer):  # an answer made for this request: (correlation id, body) -> reply
            answer = answer(correlation_id, body)
        if isinstance(answer, bytes) and accept is not None and not accept(answer):
            return None  # a reply the requester does not take: no answer
        return answer


@dataclass
class StubMessage:
    """An incoming AMQP message as consumers see it; counts acks and nacks."""

    body: bytes
    routing_key: str = ""
    message_id: str | None = None
    content_type: str | None = "application/json"
    headers: dict[str, Any] = field(default_factory=dict)
    reply_to: str | None = None
    correlation_id: str | None = None
    channel: object = None  # the channel it came on, and its tag there
    delivery_tag: int | None = None
    acked: int = 0
    acked_multiple: int = 0  # of `acked`, how many were multiple-acks
    nacked: int = 0

    async def ack(self, multiple: bool = False) -> None:
        self.acked += 1
        self.acked_multiple += multiple

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        self.nacked += 1


def submission(name: str) -> StubMessage:
    """A `submit` message of a `true` command named `name`, with a message id of its own."""
    job = {"name": name, "job": {"kind": "command", "argv": ["true"]}}
    return StubMessage(json.dumps(job).encode(), "submit", str(uuid4()))


def report(ok: bool = True, result: Any = None, error: str | None = None) -> Report:
    return Report(ok=ok, result=result, error=error)
