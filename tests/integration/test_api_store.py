"""The operator API's statements in Postgres: tokens (only a hash kept, revocation, names never
reused, last use written at most once a minute), the audit, and node cordons (kept across
heartbeats and re-registration, left out of placement's locks, lifted with a NOTIFY) with
drain waiting for the attempts that hold the node."""

from __future__ import annotations

import asyncio
from uuid import uuid4

import asyncpg
import pytest

from shared import cordon, fsm
from shared.auth import Role, digest
from shared.degrade import Mode
from shared.errors import InvalidSpec, NotFound
from shared.fsm import State
from shared.models import Task
from shared.store import NODE_CHANNEL, Store
from shared.store.tokens import NameTaken
from tests.helpers import spec


async def test_tokens_are_kept_as_hashes_and_revoked_for_good(
    store: Store, pool: asyncpg.Pool
) -> None:
    row, secret = await store.tokens.issue(Role.OPERATE, "ci-bot")
    assert (row.name, row.role, row.revoked_at, row.last_used_at) == (
        "ci-bot", Role.OPERATE, None, None
    )  # fmt: skip
    stored = await pool.fetchrow("SELECT * FROM api_tokens WHERE name = 'ci-bot'")
    assert stored["secret_sha256"] == digest(secret)
    assert secret not in str(dict(stored))  # the secret itself is nowhere

    seen = await store.tokens.authenticate(digest(secret))
    assert seen is not None
    assert seen.name == "ci-bot"
    first = (await store.tokens.all())[0].last_used_at
    assert first is not None
    await store.tokens.authenticate(digest(secret))
    assert (await store.tokens.all())[0].last_used_at == first  # at most once a minute
    assert await store.tokens.authenticate(digest(secret + "x")) is None

    other, _ = await store.tokens.issue(Role.READ)
    assert other.name.startswith("read-")
    with pytest.raises(NameTaken):
        await store.tokens.issue(Role.ADMIN, "ci-bot")
    with pytest.raises(InvalidSpec):
        await store.tokens.issue(Role.ADMIN, "no spaces please")

    revoked = await store.tokens.revoke("ci-bot")
    assert revoked is not None
    assert revoked.revoked_at is not None
    assert await store.tokens.authenticate(digest(secret)) is None
    again = await store.tokens.revoke("ci-bot")
    assert again is not None
    assert again.revoked_at == revoked.revoked_at
    assert await store.tokens.revoke("nobody") is None
    with pytest.raises(NameTaken):  # a revoked token's name stays taken: the audit names it
        await store.tokens.issue(Role.READ, "ci-bot")
    assert [t.name for t in await store.tokens.all()] == ["ci-bot", other.name]


async def test_the_audit_records_changes_newest_first(store: Store) -> None:
    await store.tokens.audit("a", "submit", "t1", "hello")
    await store.tokens.audit("b", "cancel", "t1")
    await store.tokens.audit("a", "pause", "t2", "why")
    assert [(e.token, e.action) for e in await store.tokens.audit_log()] == [
        ("a", "pause"), ("b", "cancel"), ("a", "submit")
    ]  # fmt: skip
    assert [e.target for e in await store.tokens.audit_log(token="a")] == ["t2", "t1"]
    assert len(await store.tokens.audit_log(limit=1)) == 1


async def _on(store: Store, node: str, target: State = State.RUNNING) -> Task:
    task = await store.tasks.create(spec("held"))
    for step in (State.PENDING, State.READY):
        task = await fsm.apply(store.tasks, task, step)
    task = await fsm.apply(store.tasks, task, State.SCHEDULING, node=node)
    if target is State.RUNNING:
        task = await fsm.apply(store.tasks, task, State.RUNNING, lease_owner=str(uuid4()))
    return task


async def test_a_cordon_outlives_heartbeats_and_re_registration(store: Store) -> None:
    boot = uuid4()
    await store.nodes.register("n1", 2, 2.0, 1024, 0, {"zone": "a"}, boot)
    await store.nodes.register("n2", 2, 2.0, 1024, 0, {}, uuid4())
    with pytest.raises(NotFound):
        await cordon.cordon(store, "nope", "alice")

    row = await cordon.cordon(store, "n1", "alice", "disk failing")
    assert (row.cordoned_by, row.cordon_reason) == ("alice", "disk failing")
    assert row.cordoned_at is not None
    again = await cordon.cordon(store, "n1", "bob", "other")
    assert (again.cordoned_at, again.cordoned_by) == (row.cordoned_at, "alice")  # the first

    assert await store.nodes.heartbeat("n1", boot, 0.5)
    await store.nodes.set_ready("n1", boot, True)
    await store.nodes.register("n1", 4, 2.0, 1024, 0, {"zone": "a"}, uuid4())  # a restart
    [kept] = [n for n in await store.nodes.all() if n.id == "n1"]
    assert (kept.slots, kept.cordoned_at, kept.cordoned_by) == (4, row.cordoned_at, "alice")
    assert not kept.state().ready
    assert kept.state().cordoned

    async with store.transaction() as tx:  # placement's read: n1 is left out, and says why
        rows, mode = await tx.nodes.lock_and_read()
        nodes = {n.id: n.state() for n in rows}
    assert mode is Mode.NORMAL
    assert (nodes["n1"].ready, nodes["n1"].cordoned) == (False, True)
    assert (nodes["n2"].ready, nodes["n2"].cordoned) == (True, False)


async def test_uncordon_tells_the_schedulers(store: Store) -> None:
    await store.nodes.register("n1", 2, 2.0, 1024, 0, {}, uuid4())
    await cordon.cordon(store, "n1", "alice")
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = store.listener([(NODE_CHANNEL, lambda *a: heard.put_nowait(a[-1]))])
    stop = asyncio.Event()
    listening = asyncio.create_task(listener.run(stop))
    try:
        await asyncio.wait_for(listener.connected.wait(), 10)
        row = await cordon.uncordon(store, "n1")
        assert (row.cordoned_at, row.cordoned_by, row.cordon_reason) == (None, None, None)
        assert row.state().ready
        assert await asyncio.wait_for(heard.get(), 10) == "n1"
    finally:
        stop.set()
        await listening
    with pytest.raises(NotFound):
        await cordon.uncordon(store, "nope")


async def test_drain_waits_for_the_attempts_holding_the_node(store: Store) -> None:
    await store.nodes.register("n1", 4, 4.0, 1024, 0, {}, uuid4())
    running = await _on(store, "n1")
    scheduled = await _on(store, "n1", State.SCHEDULING)
    elsewhere = await _on(store, "n2")
    assert set(await store.nodes.holders("n1")) == {running.id, scheduled.id}

    early = await cordon.drain(store, "n1", "alice", timeout=0.2)
    assert not early.done
    assert set(early.holding) == {running.id, scheduled.id}
    assert early.node.cordoned_at is not None
    assert early.node.cordon_reason == "drain"

    waiting = asyncio.create_task(cordon.drain(store, "n1", "alice", timeout=10))
    await fsm.apply(store.tasks, running, State.SUCCESS)  # running work runs to its end
    await asyncio.sleep(0.3)
    assert not waiting.done()  # the scheduled attempt still holds a slot
    await fsm.apply(store.tasks, scheduled, State.READY, reason="dispatch failed")
    done = await asyncio.wait_for(waiting, 10)
    assert done.done
    assert done.holding == []
    assert await store.nodes.holders("n2") == [elsewhere.id]
