"""Packing outbox events into as few messages as per-task order allows (pure): the relay's
messages keep each task's events in version order while unrelated events share them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar
from uuid import UUID


class Packable(Protocol):
    @property
    def task_id(self) -> UUID: ...
    @property
    def to_status(self) -> str: ...  # a State, or a state this release does not know


E = TypeVar("E", bound=Packable)


def pack(events: Sequence[E], max_per_message: int = 500) -> list[tuple[str, list[E]]]:
    """Group events into messages of one target state each (one routing key per message).

    Messages go out in list order, so an event may join an existing message only if that
    message comes no earlier than the one holding its task's previous event: every task's
    events then leave in version order, while unrelated events share messages freely.
    """
    messages: list[tuple[str, list[E]]] = []
    open_by_state: dict[str, int] = {}  # the newest message of each state still accepting
    last_of_task: dict[UUID, int] = {}
    for event in events:
        floor = last_of_task.get(event.task_id, -1)
        index = open_by_state.get(event.to_status)
        if index is None or index < floor or len(messages[index][1]) >= max_per_message:
            index = len(messages)
            messages.append((event.to_status, []))
            open_by_state[event.to_status] = index
        messages[index][1].append(event)
        last_of_task[event.task_id] = index
    return messages


def waves(messages: Sequence[tuple[str, list[E]]]) -> list[list[tuple[str, list[E]]]]:
    """`pack`'s messages in waves that may each be in flight at once: a message joins the wave
    after the latest one holding an earlier event of any of its tasks. So no two messages of a
    wave share a task, and a wave goes out only once every earlier event of its tasks was
    confirmed: a message the broker refuses holds back its tasks' later events, which can
    never overtake it (a subscriber would drop the refused one, arriving later, as stale)."""
    if len(messages) < 2:
        return [list(messages)] if messages else []
    level_of_task: dict[UUID, int] = {}  # the wave of the last message holding each task
    out: list[list[tuple[str, list[E]]]] = []
    for message in messages:
        level = 1 + max((level_of_task.get(e.task_id, -1) for e in message[1]), default=-1)
        if level == len(out):
            out.append([])
        out[level].append(message)
        for e in message[1]:
            level_of_task[e.task_id] = level
    return out
