"""Attempt leases in Postgres: taken by the start, renewed only by their owner, ended by an
outcome, kept by a pause; Lost and a next attempt wait for the lease to run out by the margin.
Every time here is Postgres's own."""

from __future__ import annotations

import asyncio
from uuid import uuid4

import pytest

from shared import fsm
from shared.errors import StaleWrite
from shared.fsm import State
from shared.models import Task
from shared.store import Store
from tests.helpers import spec

OWNER = uuid4()
TIMEOUT = 1.0  # the shortest heartbeat timeout a spec may ask for


async def running(store: Store, **kw: object) -> Task:
    task = await store.tasks.create(spec(heartbeat_timeout_s=TIMEOUT, **kw))
    for target in (State.PENDING, State.READY, State.SCHEDULING):
        task = await fsm.apply(store.tasks, task, target)
    return await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(OWNER))


async def test_a_start_takes_a_lease_and_only_its_owner_renews_it(store: Store) -> None:
    task = await running(store)
    assert (task.lease_owner, task.lease_attempt) == (OWNER, 1)
    assert task.lease_until is not None
    assert task.started_at is not None
    assert abs((task.lease_until - task.started_at).total_seconds() - TIMEOUT) < 1e-3
    assert task.hb_deadline is not None
    assert abs((task.hb_deadline - task.lease_until).total_seconds() - store.lease_margin_s) < 1e-3

    await asyncio.sleep(0.2)
    assert await store.leases.renew(uuid4(), [(task.id, 1)]) == set()  # not the owner
    assert await store.leases.renew(OWNER, [(task.id, 2)]) == set()  # not the attempt
    assert await store.leases.renew(OWNER, [(task.id, 1)]) == {(task.id, 1)}
    renewed = await store.tasks.get(task.id)
    assert renewed.lease_until is not None
    assert renewed.lease_until > task.lease_until
    assert renewed.version == task.version  # a renewal is not a state change


async def test_lost_waits_for_the_lease_to_run_out_by_the_margin(store: Store) -> None:
    task = await running(store)
    with pytest.raises(StaleWrite):  # the lease holds: a monitor's Lost loses its CAS
        await fsm.apply(store.tasks, task, State.LOST, reason="too soon")
    await asyncio.sleep(TIMEOUT + store.lease_margin_s + 0.1)
    lost = await fsm.apply(store.tasks, task, State.LOST, reason="lapsed")
    assert (lost.lease_owner, lost.lease_until) == (None, None)


async def test_an_outcome_ends_the_lease_and_a_pause_keeps_it(store: Store) -> None:
    done = await fsm.apply(store.tasks, await running(store), State.SUCCESS)
    assert (done.lease_owner, done.lease_attempt, done.lease_until) == (None, None, None)
    paused = await fsm.apply(store.tasks, await running(store), State.PAUSED, reason="x")
    assert (paused.lease_owner, paused.lease_attempt) == (OWNER, 1)
    assert paused.lease_until is not None


async def test_a_resumed_task_waits_for_its_old_attempt_unless_the_lease_is_given_back(
    store: Store,
) -> None:
    """Paused while its executor could not hear it, the old attempt may still run until its
    lease lapses: the next attempt is fenced until then — or until the executor, having
    stopped it, gives the lease back."""
    for give_back in (False, True):
        task = await fsm.apply(store.tasks, await running(store), State.PAUSED, reason="x")
        task = await fsm.apply(store.tasks, task, State.PENDING)
        task = await fsm.apply(store.tasks, task, State.READY)
        free, fenced = await store.tasks.get_ready([task.id])
        assert (free, [t.id for t in fenced]) == ([], [task.id])
        task = await fsm.apply(store.tasks, task, State.SCHEDULING)
        assert task.attempt == 2
        with pytest.raises(StaleWrite):  # the start CAS holds the fence too
            await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(OWNER))
        if give_back:
            # attempt 2 is not attempt 1: nothing of it is released
            await store.leases.release(OWNER, [(task.id, 2)])
            assert (await store.tasks.get(task.id)).lease_attempt == 1
            await store.leases.release(OWNER, [(task.id, 1)])
        else:
            await asyncio.sleep(TIMEOUT + store.lease_margin_s + 0.1)
        started = await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(OWNER))
        assert (started.lease_attempt, started.attempt) == (2, 2)


async def test_a_live_attempt_s_lease_is_never_released(store: Store) -> None:
    task = await running(store)
    await store.leases.release(OWNER, [(task.id, 1)])
    assert (await store.tasks.get(task.id)).lease_attempt == 1


async def test_deadlines_restart_after_an_outage(store: Store) -> None:
    task = await running(store)
    await asyncio.sleep(TIMEOUT + store.lease_margin_s + 0.1)
    overdue_by, _ = await store.leases.next_deadline()
    assert overdue_by is not None
    assert overdue_by < 0
    assert await store.leases.restart_deadlines() == 1
    after = await store.tasks.get(task.id)
    assert after.hb_deadline is not None
    assert after.lease_until is not None
    # the monitor looks again a timeout from now; the lease itself is not extended
    assert after.lease_until == task.lease_until
    wait_s, started = await store.leases.next_deadline()
    assert wait_s is not None
    assert TIMEOUT < wait_s <= TIMEOUT + store.lease_margin_s
    assert started > 0
    [(leased, silent_s)] = await store.leases.overdue(10, 5.0) or [(None, 0.0)]
    assert leased is None  # not overdue any more
    await asyncio.sleep(TIMEOUT + store.lease_margin_s)
    [(leased, silent_s)] = await store.leases.overdue(10, 5.0)
    # how long since the lease was renewed (at the start), by Postgres's clock
    assert (
        2 * TIMEOUT + store.lease_margin_s < silent_s < 2 * TIMEOUT + 2 * store.lease_margin_s + 1
    )
