"""A lone submission's placement told to its node by the commit that placed it (sked_admit's
NOTIFY on the node's own channel), on real Postgres: the node's executor starts the attempt
from the notification, and the dispatch message that follows starts nothing — neither while
the attempt runs nor once its outcome is written — and is acknowledged."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

import asyncpg
import pytest

from services.executor.service import Executor
from shared import fsm
from shared.dispatches import placed
from shared.fsm import State
from shared.models import Dispatch, Task
from shared.store import Placing, Store
from shared.store.notify import placed_channel
from tests.helpers import spec
from tests.integration.test_executor_claims import dispatch_of

ADMISSION = (State.PENDING, State.READY)


async def test_an_admission_tells_each_node_of_the_attempts_placed_on_it(
    store: Store, dsn: str
) -> None:
    for node in ("n1", "n2"):
        await store.nodes.register(node, 4, 0.0, 0, 0, {}, uuid4())
    boots = {n.id: n.boot_id for n in await store.nodes.all()}
    heard: dict[str, asyncio.Queue[str]] = {"n1": asyncio.Queue(), "n2": asyncio.Queue()}
    listener = await asyncpg.connect(dsn)
    try:
        for node, q in heard.items():
            await listener.add_listener(placed_channel(node), lambda *a, q=q: q.put_nowait(a[3]))
        specs = [spec("a"), spec("b", max_retries=2), spec("c")]
        ids = [uuid4() for _ in specs]
        moves = [
            fsm.plan(
                fsm.Newborn(i, State.READY, 3, s.max_retries, s.max_launch_failures),
                State.SCHEDULING,
                "placed",
                node=node,
            )
            for i, s, node in zip(ids, specs, ["n1", "n1", "n2"], strict=True)
        ]
        admitted = await store.tasks.admit_many(
            specs, ids, ADMISSION, None, Placing(moves, boots, 10.0)
        )
        told = {n: await asyncio.wait_for(q.get(), 10) for n, q in heard.items()}
    finally:
        await listener.close()
    tasks = {t.id: t for t, _ in admitted}
    for node, payload in told.items():
        dispatches = {e.dispatch for e in placed(payload, node)}
        mine = {Dispatch.of(t) for t in tasks.values() if t.node == node}
        assert dispatches == mine, payload
    assert {d.max_retries for e in placed(told["n1"], "n1") if (d := e.dispatch)} == {0, 2}


def payload_of(task: Task) -> str:
    """What sked_admit tells a node of a task it placed there (sql: placed_payload)."""
    return f"{task.id}:{task.version}:{task.attempt}:{task.retry_count}:{task.max_retries}"


async def test_a_notified_attempt_starts_once_and_its_dispatch_message_only_settles(
    executor: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, starter = executor.node, executor.starter
    task = await executor.store.tasks.create(spec("told"))
    for target in (State.PENDING, State.READY):
        task = await fsm.apply(executor.store.tasks, task, target)
    task = await fsm.apply(executor.store.tasks, task, State.SCHEDULING, node="n1")
    node.placed(None, 0, placed_channel("n1"), f"{payload_of(task)} junk {uuid4()}:1:x:0:0")
    told = node.inbox.get_nowait()
    assert told is not None
    assert len(told) == 1  # what is not sked's is skipped
    assert await starter.start_items(told) == 1
    key = (task.id, task.attempt)
    assert key in node.active

    claims = 0
    real = executor.store.tasks.transition_many

    async def counted(moves: Any) -> list[Task]:
        nonlocal claims
        claims += sum(m.target is State.RUNNING for m in moves)
        return await real(moves)

    monkeypatch.setattr(executor.store.tasks, "transition_many", counted)
    behind = dispatch_of(task)  # the dispatch message, arriving while the attempt runs
    assert await starter.start([behind]) == 0  # type: ignore[list-item]
    assert behind.acked == 1  # a copy of an attempt running here: acknowledged at once
    await asyncio.wait(node.runs, timeout=30)
    outcome = node.outcomes.get_nowait()
    assert outcome is not None
    await executor.finisher.finish([outcome])
    assert behind.acked == 1
    assert (await executor.store.tasks.get(task.id)).status is State.SUCCESS

    again = dispatch_of(task)  # redelivered once the outcome is written
    assert await starter.start([again]) == 0  # type: ignore[list-item]
    assert again.acked == 1
    assert claims == 0  # neither copy cost a claim statement that could only lose


async def test_a_late_notification_never_takes_the_place_of_the_dispatch_message(
    executor: Executor,
) -> None:
    """The other order: the dispatch message started the attempt and the notification comes
    after (its listener lagged). The message is still the one acknowledged with the outcome:
    a notification has nothing to acknowledge, and were it kept instead, the message would
    stay unacknowledged until its channel closed, then be delivered again."""
    node, starter = executor.node, executor.starter
    task = await executor.store.tasks.create(spec("late notice"))
    for target in (State.PENDING, State.READY):
        task = await fsm.apply(executor.store.tasks, task, target)
    task = await fsm.apply(executor.store.tasks, task, State.SCHEDULING, node="n1")
    message = dispatch_of(task)
    assert await starter.start([message]) == 1  # type: ignore[list-item]
    node.placed(None, 0, placed_channel("n1"), payload_of(task))
    told = node.inbox.get_nowait()
    assert told is not None
    assert await starter.start_items(told) == 0
    await asyncio.wait(node.runs, timeout=30)
    outcome = node.outcomes.get_nowait()
    assert outcome is not None
    await executor.finisher.finish([outcome])
    assert message.acked == 1
