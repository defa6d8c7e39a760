"""The executor's start claim on real Postgres: a claim whose COMMIT went through but whose
reply was lost is recognised as this executor's own (not dropped into a loss), and of two
dispatches of one task in a batch the newer attempt is the one claimed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.executor.node import items_of
from services.executor.service import Executor
from shared import fsm
from shared.fsm import State
from shared.models import Dispatch, Task
from tests.fakes import StubMessage
from tests.helpers import spec


def dispatch_of(task: Task) -> StubMessage:
    body = Dispatch.of(task, "n1")
    return StubMessage(body.model_dump_json().encode(), "n1")


async def scheduled(executor: Executor) -> Task:
    task = await executor.store.tasks.create(spec("claimed"))
    for target in (State.PENDING, State.READY):
        task = await fsm.apply(executor.store.tasks, task, target)
    return await fsm.apply(executor.store.tasks, task, State.SCHEDULING, node="n1")


async def test_a_claim_whose_reply_was_lost_is_still_ours(
    executor: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = await scheduled(executor)
    real = executor.store.tasks.transition_many
    calls = 0

    async def reply_lost(moves: Any) -> list[Task]:
        nonlocal calls
        calls += 1
        moved = await real(moves)
        if calls == 1:
            raise ConnectionResetError("the COMMIT went through; its reply did not")
        return moved

    monkeypatch.setattr(executor.store.tasks, "transition_many", reply_lost)
    message = dispatch_of(task)
    assert await executor.starter.start([message]) == 1  # type: ignore[list-item]
    assert calls == 2
    assert (task.id, 1) in executor.node.active
    await asyncio.wait(executor.node.runs, timeout=30)
    attempt, outcome = executor.node.outcomes.get_nowait()  # type: ignore[misc]
    assert (attempt.task.id, outcome.ok) == (task.id, True)  # it ran, once
    assert message.acked == 1  # acknowledged once claimed (RabbitMQ's consumer_timeout)


async def test_the_newer_of_two_dispatches_in_a_batch_is_claimed(executor: Executor) -> None:
    first = await scheduled(executor)
    back = await fsm.apply(executor.store.tasks, first, State.READY, reason="dispatch lost")
    second = await fsm.apply(executor.store.tasks, back, State.SCHEDULING, node="n1")
    old, new = dispatch_of(first), dispatch_of(second)
    assert await executor.starter.start([old, new]) == 1  # type: ignore[list-item]
    assert old.acked == 1  # the stale one is dropped
    assert new.acked == 1  # claimed: acknowledged
    assert (second.id, 2) in executor.node.active
    await asyncio.wait(executor.node.runs, timeout=30)


async def test_an_outcome_and_a_held_claim_whose_reply_was_lost_are_still_ours(
    executor: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outcome and the claim of a held dispatch taking its slot go in one statement; if
    its COMMIT went through but the reply was lost, the retry loses both CAS to itself: the
    end is recognised as applied (not a late result), the claim as this executor's own."""
    first, second = await scheduled(executor), await scheduled(executor)
    assert await executor.starter.start([dispatch_of(first)]) == 1  # type: ignore[list-item]
    await asyncio.wait(executor.node.runs, timeout=30)
    ended = executor.node.outcomes.get_nowait()
    assert ended is not None
    held = dispatch_of(second)
    executor.starter.held.extend(items_of(held))  # type: ignore[arg-type]
    real = executor.store.tasks.transition_many
    calls: list[list[State]] = []

    async def reply_lost(moves: Any) -> list[Task]:
        calls.append([m.target for m in moves])
        moved = await real(moves)
        if len(calls) == 1:
            raise ConnectionResetError("the COMMIT went through; its reply did not")
        return moved

    monkeypatch.setattr(executor.store.tasks, "transition_many", reply_lost)
    await executor.finisher.finish([ended])
    assert calls == [[State.SUCCESS, State.RUNNING]] * 2
    done = await executor.store.tasks.get(first.id)
    assert done.status is State.SUCCESS
    late = await executor.store.pool.fetchval("SELECT count(*) FROM late_results")
    assert late == 0
    running = await executor.store.tasks.get(second.id)
    assert (running.status, running.lease_owner) == (State.RUNNING, executor.node.boot_id)
    assert (second.id, 1) in executor.node.active
    assert not executor.starter.held
    assert executor.starter.claiming == 0
    if executor.node.runs:
        await asyncio.wait(executor.node.runs, timeout=30)
    attempt, outcome = executor.node.outcomes.get_nowait()  # type: ignore[misc]
    assert (attempt.task.id, outcome.ok) == (second.id, True)  # it ran, once
    assert held.acked == 1  # acknowledged once claimed (RabbitMQ's consumer_timeout)
