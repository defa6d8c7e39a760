"""Packing outbox events into as few messages as per-task order allows (pure): the relay's
messages keep each task's events in version order while unrelated events share them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar
from uuid import UUID

from shared.fsm import State


class Packable(Protocol):
    @property
    def task_id(self) -> UUID: ...
    @property
    def to_status(self) -> State: ...


E = TypeVar("E", bound=Packable)


def pack(events: Sequence[E], max_per_message: int = 500) -> list[tuple[State, list[E]]]:
    """Group events into messages of one target state each (one routing key per message).

    Messages go out in list order, so an event may join an existing message only if that
    message comes no earlier than the one holding its task's previous event: every task's
    events then leave in version order, while unrelated events share messages freely.
    """
    messages: list[tuple[State, list[E]]] = []
    open_by_state: dict[State, int] = {}  # the newest message of each state still accepting
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
