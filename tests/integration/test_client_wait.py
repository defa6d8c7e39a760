"""The SDK's wait against Postgres: what wakes it, and what it asks Postgres for."""

from __future__ import annotations

import asyncio
from uuid import UUID, uuid4

import pytest

from shared import fsm
from shared.client import SkedClient
from shared.errors import InvalidSpec
from shared.fsm import State
from shared.models import Task
from shared.settings import Settings
from shared.store import Store
from shared.sync_client import SyncSkedClient
from tests.helpers import spec


async def test_a_waiter_asks_about_a_task_only_when_it_moves_into_an_end(
    settings: Settings, store: Store
) -> None:
    """Each notification names the tasks a statement moved and where to: a waiter checks the
    named tasks it waits for only when a move ends one. Before, each of a task's moves (Ready,
    Scheduling, Running) cost a waiter a query. Two tasks are waited for, so that a check of the
    one that moves alone is told from the once-a-second check of all."""
    moving, idle = await store.tasks.create_many([spec(name="moving"), spec(name="idle")])
    async with SkedClient(settings) as client:
        waiter_store = await client._db()
        checks: list[set[UUID]] = []
        real = waiter_store.tasks.terminal_among

        async def counted(ids: list[UUID]) -> list[Task]:
            checks.append(set(ids))
            return await real(ids)

        waiter_store.tasks.terminal_among = counted  # type: ignore[method-assign]
        waiting = asyncio.create_task(client.wait_all([moving.id, idle.id], timeout=30))
        for _ in range(100):  # its first look, at both, once it listens
            if checks:
                break
            await asyncio.sleep(0.01)
        task = moving
        for target, patch in (
            (State.PENDING, {}),
            (State.READY, {}),
            (State.SCHEDULING, {"node": "n1"}),
            (State.RUNNING, {"lease_owner": str(uuid4())}),
        ):
            task = await fsm.apply(store.tasks, task, target, **patch)
            await asyncio.sleep(0.05)  # its notification reaches the waiter
        assert {moving.id} not in checks, checks  # no move of it so far could end it
        await fsm.apply(store.tasks, task, State.SUCCESS, result=1)
        for _ in range(200):
            if {moving.id} in checks:
                break
            await asyncio.sleep(0.01)
        assert {moving.id} in checks, checks  # its end: looked at by itself, at once
        await fsm.apply(store.tasks, idle, State.CANCELED)
        done = await asyncio.wait_for(waiting, 10)
    assert done[moving.id].status is State.SUCCESS
    assert done[idle.id].status is State.CANCELED


async def test_the_sync_client_reads_and_pages_without_a_loop(
    settings: Settings, store: Store
) -> None:
    """SyncSkedClient, as code without an event loop (here a thread) calls it: a listing in
    pages of two, a task, its history."""
    made = await store.tasks.create_many([spec(name=f"s{i}") for i in range(3)])

    def reads() -> tuple[list[Task], Task, int]:
        with SyncSkedClient(settings) as sked:
            first = sked.tasks(limit=2)
            rest = sked.tasks(limit=2, after=first[-1].id)
            return [*first, *rest], sked.get(made[0].id), len(sked.history(made[0].id))

    listed, got, events = await asyncio.to_thread(reads)
    newest_first = sorted(made, key=lambda t: (-t.created_at.timestamp(), t.id))
    assert [t.id for t in listed] == [t.id for t in newest_first]
    assert (got.id, got.name, events) == (made[0].id, "s0", 1)


async def test_a_wait_of_nan_seconds_is_refused_not_endless(settings: Settings) -> None:
    async with SkedClient(settings) as client:
        for wait in (
            client.wait(uuid4(), float("nan")),
            client.wait_workflow(uuid4(), float("nan")),
        ):
            with pytest.raises(InvalidSpec, match="NaN"):
                await asyncio.wait_for(wait, 10)
