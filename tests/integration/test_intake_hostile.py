"""Hostile producers against intake and workflows, on real Postgres, Redis and RabbitMQ with an
in-process scheduler (every loop under `supervise`, as in production). Each case was found by
an adversarial review and once stopped a scheduler, lost or forged a task's input, or gave the
producer no clear answer; each is now refused with a reason, or handled, and nothing else is
lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

import asyncpg
import pytest

from services.scheduler.service import Scheduler
from shared import fsm, workflows
from shared.client import SkedClient
from shared.dag import WorkflowSpec
from shared.errors import InvalidSpec, NotFound
from shared.fsm import State
from shared.models import TaskSpec
from shared.settings import Settings
from shared.store import Store
from shared.wiring import Backends, backends
from tests.helpers import eventually


@dataclass
class Running:
    b: Backends
    scheduler: Scheduler
    task: asyncio.Task[None]
    client: SkedClient

    def alive(self) -> bool:
        if self.task.done():
            raise AssertionError(f"the scheduler stopped: {self.task.exception()!r}")
        return True

    async def get(self, task_id: UUID) -> Any:
        """The task, or None while it is not admitted; the scheduler must be alive."""
        self.alive()
        with contextlib.suppress(NotFound):
            return await self.b.store.tasks.get(task_id)
        return None


Before = Callable[[Store], Awaitable[None]]


@pytest.fixture
async def start(settings: Settings) -> AsyncIterator[Callable[[Before | None], Awaitable[Running]]]:
    """Start a scheduler service in this process, after `before` wrote what the database
    holds when it starts; and an SDK client on the same deployment."""
    fast = settings.model_copy(update={"reconcile_s": 0.3})
    started: list[Running] = []
    async with backends(fast) as b:

        async def run(before: Before | None = None) -> Running:
            if before is not None:
                await before(b.store)
            scheduler = Scheduler(fast, b.store, b.bus, b.ready_queue)
            task = asyncio.create_task(scheduler.run())
            await asyncio.wait_for(scheduler.ready.wait(), 30)
            started.append(Running(b, scheduler, task, SkedClient(fast)))
            return started[-1]

        try:
            yield run
        finally:
            for r in started:
                await r.client.close()
                r.scheduler.stop()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(r.task, 30)


@pytest.fixture
async def running(start: Callable[[Before | None], Awaitable[Running]]) -> Running:
    return await start(None)


def cmd(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "command": ["true"], **kw}


async def dead_reasons(client: SkedClient) -> list[str]:
    return [d.reason for d in await client.dead_letters(1000)]


# -- numbers Postgres cannot hold where it uses them -------------------------------------------


def test_a_dependency_timeout_or_a_capacity_past_what_postgres_adds_is_refused() -> None:
    """Intake judges a workflow message with WorkflowSpec.parse (as the SDK does before
    sending): a dependency timeout Postgres cannot add to a timestamp, or a capacity past its
    integer, is refused with the field named, not stored."""
    for bad, field in (
        ({"tasks": [cmd("a"), cmd("b", needs=[{"task": "a", "timeout_s": 1e13}])]}, "timeout_s"),
        ({"resources": {"lock": 2**31}, "tasks": [cmd("a", uses=["lock"])]}, "resources.lock"),
    ):
        with pytest.raises(InvalidSpec, match=field):
            WorkflowSpec.parse({"name": "w", **bad})


async def test_a_stored_dependency_timeout_past_a_timestamp_stops_no_scheduler(
    start: Callable[[Before | None], Awaitable[Running]], pool: asyncpg.Pool
) -> None:
    """A timeout stored before it was bounded (1e13 s): the resolver's read added it to a
    timestamp ("timestamp out of range", not transient), and the scheduler stopped at every
    start. Now the wait is measured in seconds: the downstream is decided when its upstream
    ends, and the scheduler runs on."""
    wf = uuid4()

    async def stored(store: Store) -> None:
        spec = {"tasks": [cmd("a"), cmd("b", needs=[{"task": "a", "timeout_s": 60}])]}
        await workflows.admit(store, wf, WorkflowSpec.parse({"name": "w", **spec}))
        await pool.execute("UPDATE task_deps SET timeout_s = 1e13")

    running = await start(stored)
    a = await running.get(workflows.task_id(wf, "a"))
    await fsm.apply(running.b.store.tasks, a, State.CANCELED, reason="operator")

    async def skipped() -> bool:
        b = await running.get(workflows.task_id(wf, "b"))
        return b.status is State.SKIPPED

    await eventually(skipped, timeout=10, what="the downstream decided")
    await asyncio.sleep(1.0)  # a few resolver sweeps (reconcile_s 0.3)
    assert running.alive()


async def test_a_stored_capacity_past_an_integer_stops_no_scheduler(
    start: Callable[[Before | None], Awaitable[Running]], pool: asyncpg.Pool
) -> None:
    """A capacity stored before it was bounded (2**31): placement's read cast it to an int
    ("out of range", not transient), and the scheduler stopped at every start, popping the
    same task first. Now it reads as the integer's most, and the task is placed."""
    wf = uuid4()

    async def stored(store: Store) -> None:
        await store.nodes.register("n1", 4, 4.0, 4096, 0, {}, uuid4())
        spec = {"resources": {"lock": 1}, "tasks": [cmd("a", uses=["lock"])]}
        await workflows.admit(store, wf, WorkflowSpec.parse({"name": "w", **spec}))
        await pool.execute(
            "UPDATE workflows SET spec = jsonb_set(spec, '{resources,lock}', '2147483648')"
        )

    running = await start(stored)  # its queue rebuilt from Postgres: the task is popped

    async def placed() -> bool:  # placed at least once (no executor takes it here)
        running.alive()
        events = await running.b.store.tasks.history(workflows.task_id(wf, "a"))
        return any(e.to_status is State.SCHEDULING for e in events)

    await eventually(placed, timeout=10, what="the task placed")
    await asyncio.sleep(1.0)
    assert running.alive()


# -- idempotency keys and ids ------------------------------------------------------------------


async def test_a_key_held_by_a_workflow_task_is_refused_with_the_task_named(
    running: Running,
) -> None:
    """A workflow task holds idempotency key "k" (its id comes from the workflow and its name,
    not from the key). A standalone submission with "k" gets the id uuid5("k") from the SDK;
    intake found the workflow task by the key, compared specs only under the submitted id, and
    acknowledged the message: the id the producer held named no task, and a wait for it never
    ended. Now it is refused, naming the task and workflow that hold the key."""
    wf = await running.client.submit_workflow(
        {"name": "w", "tasks": [cmd("a", idempotency_key="k")]}
    )
    holder = workflows.task_id(wf, "a")
    await eventually(lambda: running.get(holder), timeout=10, what="the workflow admitted")
    other = {
        "name": "other",
        "job": {"kind": "command", "argv": ["rm", "-rf", "/tmp/x"]},
        "idempotency_key": "k",
    }
    returned = await running.client.submit(other)

    async def refused() -> list[str]:
        running.alive()
        return [r for r in await dead_reasons(running.client) if "idempotency key 'k'" in r]

    reasons = await eventually(refused, timeout=10, what="the submission refused")
    assert f"task {holder}, task 'a' of workflow {wf}" in reasons[0]
    assert await running.get(returned) is None


async def test_a_workflow_never_adopts_a_task_made_under_its_task_s_id(store: Store) -> None:
    """A workflow's task ids are uuid5(workflow id, name): anyone who knows (or chose) the
    workflow's message id knows them. A task made first under the id of task `b` (another
    spec, no workflow) was adopted by the admission, the workflow's edges pointing at it. Now
    the whole workflow is refused, naming the task."""
    wf = uuid4()
    foreign = TaskSpec.parse(
        {"name": "b", "job": {"kind": "command", "argv": ["curl", "evil.example"]}}
    )
    await store.tasks.create_many(
        [foreign], [workflows.task_id(wf, "b")], walk=(State.PENDING, State.READY)
    )
    spec = WorkflowSpec.parse({"name": "w", "tasks": [cmd("a"), cmd("b", needs=["a"])]})
    with pytest.raises(InvalidSpec, match=r"task 'b': its id .* outside this workflow"):
        await workflows.admit(store, wf, spec)
    with pytest.raises(NotFound):  # nothing of it was written
        await store.workflows.get(wf)
    with pytest.raises(NotFound):
        await store.tasks.get(workflows.task_id(wf, "a"))


async def test_the_same_keyed_submission_twice_is_one_task_not_a_conflict(
    running: Running,
) -> None:
    """A producer retries a keyed submission (at-least-once publishing) whose args hold 1e23.
    jsonb keeps it as the exact decimal, which reads back as the integer 10**23, not the float
    1e23: the retry was dead-lettered as another spec under the same key. Now specs compare
    as JSON, numbers by value; and so does a workflow delivered twice."""
    spec = {
        "name": "f",
        "job": {"kind": "handler", "handler": "m:f", "args": [1e23, 0.1]},
        "idempotency_key": "retry-me",
    }
    first = await running.client.submit(spec)
    assert await running.client.submit(spec) == first
    flow = {"name": "w", "tasks": [{"name": "a", "handler": "m:f", "args": [1e23]}]}
    wf = uuid4()
    parsed = WorkflowSpec.parse(flow)
    await workflows.admit(running.b.store, wf, parsed)
    assert await workflows.admit(running.b.store, wf, parsed) == []  # the same one again
    marker = await running.client.submit({"name": "m", "job": {"kind": "command", "argv": ["x"]}})
    await eventually(lambda: running.get(marker), timeout=10, what="the marker admitted")
    await asyncio.sleep(1.0)  # dead letters are published after the batch's admission
    assert await dead_reasons(running.client) == []


# -- workflow shapes ---------------------------------------------------------------------------


def test_a_workflow_s_shape_is_refused_where_it_would_lose_an_edge_or_an_input() -> None:
    """Each refused with the task and the reason named, where it was once admitted and lost
    something: one upstream needed twice (one edge a pair is stored: the other condition was
    dropped, and `b` ran where it should have been skipped); a task's name or job set as an
    option (two upstreams handed their outputs downstream under one name, one lost)."""
    twice = [
        cmd("a"),
        cmd("b", needs=[{"task": "a"}, {"task": "a", "condition": "on_failure"}]),
    ]
    renamed = [
        {"name": "a", "handler": "m:f", "options": {"name": "b"}},
        {"name": "b", "handler": "m:f"},
    ]
    rejobbed = [{"name": "a", "handler": "m:f", "job": {"kind": "command", "argv": ["sh"]}}]
    for tasks, reason in (
        (twice, "task 'b' needs 'a' twice"),
        (renamed, "name cannot be set as an option"),
        (rejobbed, "job cannot be set as an option"),
    ):
        with pytest.raises(InvalidSpec, match=reason):
            WorkflowSpec.parse({"name": "w", "tasks": tasks})


async def test_the_sdk_answers_a_malformed_workflow_or_a_non_number_with_invalid_spec(
    settings: Settings,
) -> None:
    """What the SDK cannot send is InvalidSpec naming the field, never a bare TypeError nor a
    changed spec: `options` that is not a mapping (pydantic wraps only ValueError), NaN or
    Infinity in args or an edge's default (pydantic wrote them as null, and the handler ran
    with None). YAML's empty `needs:` (null) is no needs."""
    nan, inf = float("nan"), float("inf")
    client = SkedClient(settings)
    try:
        for bad in (
            [cmd("a", options=["x"])],
            [cmd("a", needs="b"), cmd("b")],
            [{"name": "a", "handler": "m:f", "args": [nan]}],
            [cmd("a"), cmd("b", needs=[{"task": "a", "on_timeout": "default", "default": inf}])],
        ):
            with pytest.raises(InvalidSpec):
                await client.submit_workflow({"name": "w", "tasks": bad})
        for value in (nan, inf, -inf):
            with pytest.raises(InvalidSpec, match="finite"):
                await client.submit(
                    {"name": "n", "job": {"kind": "handler", "handler": "m:f", "args": [value]}}
                )
        assert (
            WorkflowSpec.parse({"name": "w", "tasks": [cmd("a", needs=None)]}).tasks[0].needs == []
        )
    finally:
        await client.close()


# -- heartbeats --------------------------------------------------------------------------------


async def test_a_forged_non_ascii_heartbeat_token_is_a_403_not_a_500(store: Store) -> None:
    """A bearer token with a non-ASCII character made hmac.compare_digest (on two str) raise
    TypeError: a 500 and a logged traceback per request. It is a forged token: 403, counted
    as refused."""
    from aiohttp.test_utils import TestClient, TestServer

    from services.heartbeat_monitor.beats import Beats
    from services.heartbeat_monitor.http import make_app

    beats = Beats(store)
    client = TestClient(TestServer(make_app(beats, "secret-secret-secret-secret-0123")))
    await client.start_server()
    try:
        beat = {"task_id": str(uuid4()), "attempt": 1, "seq": 1}
        for forged in ("\u00e9" * 64, "sked\udcff"):
            response = await client.post(
                "/heartbeat", json=beat, headers={"Authorization": f"Bearer {forged}"}
            )
            assert response.status == 403, await response.text()
        assert beats.stats["refused"] == 2
    finally:
        await client.close()
