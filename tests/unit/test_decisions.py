"""The services' decisions on fakes (tests.fakes), in milliseconds: dispatch order and
placement, parking and resource waiters, claim-before-start, late results, the monitor's
verdicts, intake's refusals. The same behaviour on real servers: tests/integration, e2e."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import pytest

from services.executor.backends.stub import StubBackend
from services.executor.finish import Finisher
from services.executor.node import Attempt, Node, items_of
from services.executor.start import Starter
from services.executor.watch import Watcher
from services.heartbeat_monitor.ladder import Ladder
from services.scheduler.dispatch import Dispatcher
from services.scheduler.hub import Hub
from services.scheduler.intake import MAX_SENDING, Intake
from shared import heartbeat
from shared.bus import UNROUTABLE
from shared.degrade import Mode
from shared.dispatches import pack, unpack
from shared.fsm import State
from shared.heartbeat import ProbeAnswer, Rung
from shared.models import Dispatch, Task, TaskSpec
from shared.outcome import Report
from shared.queues import FENCED_KEY, RESOURCE_KEY
from shared.settings import Settings
from tests.fakes import FakeReadyQueue, InMemoryStore, StubBus, StubMessage, new_task

SETTINGS = Settings(heartbeat_secret="unit-test-secret-0123456789", node_id="n1")
# dispatch messages sent with their placement, not after the follower's wait (follow.py)
SECRET = SETTINGS.heartbeat_secret  # what executors sign their probe answers with
AT_ONCE = SETTINGS.model_copy(update={"dispatch_follow_s": 0.0})


def spec(name: str = "t", **kw: Any) -> TaskSpec:
    return TaskSpec.parse({"name": name, "job": {"kind": "command", "argv": ["true"]}, **kw})


async def ready(store: InMemoryStore, s: TaskSpec, **fields: Any) -> Task:
    return await store.walk(store.put(new_task(s, **fields)), State.PENDING, State.READY)


def scheduler_parts(
    store: InMemoryStore,
) -> tuple[Dispatcher, FakeReadyQueue, StubBus, Hub]:
    queue, bus, hub = FakeReadyQueue(), StubBus(), Hub()
    return Dispatcher(SETTINGS, store, bus, queue, hub), queue, bus, hub  # type: ignore[arg-type]


def dispatched(bus: StubBus) -> list[Dispatch]:
    return [e.dispatch for _, m in bus.published for e in unpack(m.body) if e.dispatch]


# -- dispatch ---------------------------------------------------------------------------------


async def test_dispatch_places_by_priority_then_fifo_within_capacity() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=2)
    store.nodes.add("b", slots=1)
    dispatcher, queue, bus, _ = scheduler_parts(store)
    low = await ready(store, spec("low", priority=0))
    high = [await ready(store, spec(f"high{i}", priority=5)) for i in range(3)]
    await queue.push([low, *high])
    assert await dispatcher.dispatch_once() == 3  # three slots in all
    sent = dispatched(bus)
    assert [d.task_id for d in sent] == [t.id for t in high]  # the highs, in FIFO order
    assert sorted(d.node for d in sent) == ["a", "a", "b"]
    for d in sent:
        assert (await store.tasks.get(d.task_id)).status is State.SCHEDULING
    assert await queue.pop(10) == [low.id]  # the low one waits in line: no room


async def test_degraded_dispatch_partial_lets_only_urgent_tasks_through_full_none() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=20)
    dispatcher, queue, bus, _ = scheduler_parts(store)
    low = [await ready(store, spec(f"low{i}", priority=0)) for i in range(3)]
    urgent = [await ready(store, spec(f"urgent{i}", priority=500)) for i in range(12)]
    await queue.push([*low, *urgent])
    state = await store.degrade.read()
    full = await store.degrade.set(Mode.FULL, "test", "t", None, state.version)
    assert full is not None
    assert await dispatcher.dispatch_once() == 0  # full: nothing, whatever its priority
    partial = await store.degrade.set(Mode.PARTIAL, "test", "t", None, full.version)
    assert partial is not None
    sent = await dispatcher.dispatch_once()
    assert sent == dispatcher.settings.degrade_partial_batch  # a small batch per pass
    assert {d.task_id for d in dispatched(bus)} <= {t.id for t in urgent}
    assert await dispatcher.dispatch_once() == 2  # the other urgent ones; the low ones wait
    assert {t.id for t in low} <= set(await queue.pop(20))
    # a fresh submission placed at admission (no queue ahead) obeys the mode as well
    async with store.transaction() as tx:
        moved, waiting = await dispatcher.place(tx, [await ready(store, spec("new"))])
    assert moved == []
    assert "partial mode" in next(iter(waiting.values())).reason


async def test_a_task_no_node_can_take_is_parked_with_its_reason() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=4, gpu=0)
    dispatcher, queue, bus, hub = scheduler_parts(store)
    big = await ready(store, spec("big", resources={"gpu": 2}))
    small = await ready(store, spec("small"))
    await queue.push([big, small])
    assert await dispatcher.dispatch_once() == 1
    assert [d.task_id for d in dispatched(bus)] == [small.id]
    assert queue.parked() == {big.id}
    assert store.data.wait_reasons[big.id] == "no node has gpu >= 2"
    assert hub.dispatch.is_set()  # what was behind it gets the slots at once


async def test_resource_waiters_wait_aside_and_a_holder_s_end_brings_them_back() -> None:
    store = InMemoryStore()
    store.nodes.add("a", slots=4)
    dispatcher, queue, bus, hub = scheduler_parts(store)
    wf = uuid4()
    store.data.resources[(wf, "lock")] = 1
    first, second = [
        await ready(store, spec(f"w{i}"), workflow_id=wf, uses=["lock"]) for i in range(2)
    ]
    other = await ready(store, spec("other"))
    await queue.push([first, second, other])
    assert await dispatcher.dispatch_once() == 2
    assert {d.task_id for d in dispatched(bus)} == {first.id, other.id}
    assert queue.parked(RESOURCE_KEY) == {second.id}
    assert RESOURCE_KEY in hub.waiting_aside
    assert "waiting for resource lock (1/1 held)" in store.data.wait_reasons[second.id]
    # the holder ends; the notification sends the waiter back in line, and it is placed
    holder = await store.tasks.get(first.id)
    await store.walk(holder, State.RUNNING)
    await store.walk(await store.tasks.get(first.id), State.SUCCESS)
    hub.task_notify(None, 0, "", f"{first.id}:9:success")
    assert hub.unpark_resources.is_set()
    await queue.unpark(RESOURCE_KEY)
    assert await dispatcher.dispatch_once() == 1
    assert dispatched(bus)[-1].task_id == second.id


async def test_a_resumed_task_whose_old_attempt_holds_a_lease_waits_aside() -> None:
    """Fenced until the lease ends, it waits in FENCED_KEY, not at the head of the line (where
    every pass popped it again for slots it could not use); a task end brings it back."""
    store = InMemoryStore()
    store.nodes.add("a")
    dispatcher, queue, bus, hub = scheduler_parts(store)
    task = await ready(store, spec("paused", heartbeat_timeout_s=30))
    task = await store.walk(task, State.SCHEDULING, node="a")
    task = await store.walk(task, State.RUNNING, lease_owner=str(uuid4()))
    task = await store.walk(task, State.PAUSED, State.PENDING, State.READY)
    await queue.push([task])
    assert await dispatcher.dispatch_once() == 0
    assert bus.published == []
    assert "waiting for attempt 1 to stop" in store.data.wait_reasons[task.id]
    assert await queue.size() == 0
    assert queue.parked(FENCED_KEY) == {task.id}
    assert FENCED_KEY in hub.waiting_aside
    assert hub.dispatch.is_set()  # what was behind it gets the slots at once


# -- intake ----------------------------------------------------------------------------------


async def test_intake_refuses_a_reused_key_and_admits_the_rest_of_the_batch() -> None:
    store = InMemoryStore()
    dispatcher, queue, bus, hub = scheduler_parts(store)
    intake = Intake(SETTINGS, store, bus, queue, hub, dispatcher)  # type: ignore[arg-type]
    keyed = {"name": "k", "job": {"kind": "command", "argv": ["true"]}, "idempotency_key": "K"}
    messages = [
        StubMessage(json.dumps(keyed).encode(), "submit", str(uuid4())),
        StubMessage(json.dumps(keyed).encode(), "submit", str(uuid4())),  # the same: one task
        StubMessage(json.dumps({**keyed, "max_retries": 2}).encode(), "submit"),  # refused
        StubMessage(b"[" * 10_000, "submit"),  # refused
        StubMessage(json.dumps({**keyed, "idempotency_key": "L"}).encode(), "submit"),
    ]
    admitted = await intake.accept(messages)  # type: ignore[arg-type]
    assert {t.idempotency_key for t in admitted} == {"K", "L"}
    assert [why for _, why in bus.dead] == [
        "idempotency key 'K' already names task "
        f"{admitted[0].id}, submitted with a different spec: a key (or message id) stands for "
        "one task; use a new one for a different task",
        "unsafe JSON: nested deeper than 64 levels",
    ]
    assert messages[-1].acked == 1  # one multiple-ack for the batch


class GatedBus(StubBus):
    """A bus whose publishes wait for `gate` (RabbitMQ's confirms, slow to come back)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def publish(self, exchange: str, messages: Any) -> None:
        await self.gate.wait()
        await super().publish(exchange, messages)


async def test_intake_admits_the_next_submission_while_a_dispatch_awaits_its_confirm() -> None:
    """A placed submission's dispatch is confirmed in the background: accept() returns (and
    acknowledges the submission) with the task committed Scheduling; the dispatch goes out
    once RabbitMQ answers. One that fails to go out is taken back to Ready and queued. (Sent
    at once, not after the follower's wait: what its node is told by notification is the
    next test's.)"""
    store = InMemoryStore()
    store.nodes.add("a", slots=4)
    queue, bus, hub = FakeReadyQueue(), GatedBus(), Hub()
    dispatcher = Dispatcher(AT_ONCE, store, bus, queue, hub)  # type: ignore[arg-type]
    intake = Intake(AT_ONCE, store, bus, queue, hub, dispatcher)  # type: ignore[arg-type]
    job = {"name": "x", "job": {"kind": "command", "argv": ["true"]}}
    first = StubMessage(json.dumps(job).encode(), "submit", str(uuid4()))
    [task] = await asyncio.wait_for(intake.accept([first]), 5)  # type: ignore[list-item]
    assert first.acked == 1
    assert (await store.tasks.get(task.id)).status is State.SCHEDULING
    assert bus.published == []  # still waiting for its confirm
    second = StubMessage(json.dumps({**job, "name": "y"}).encode(), "submit", str(uuid4()))
    [other] = await asyncio.wait_for(intake.accept([second]), 5)  # type: ignore[list-item]
    bus.gate.set()
    await asyncio.wait_for(asyncio.gather(*intake._sending), 5)
    assert {d.task_id for d in dispatched(bus)} == {task.id, other.id}

    bus.gate.clear()
    third = StubMessage(json.dumps({**job, "name": "z"}).encode(), "submit", str(uuid4()))
    [lost] = await asyncio.wait_for(intake.accept([third]), 5)  # type: ignore[list-item]
    bus.fail_publish = ConnectionResetError("broker gone")
    bus.gate.set()
    await asyncio.wait_for(asyncio.gather(*intake._sending), 5)
    assert (await store.tasks.get(lost.id)).status is State.READY  # taken back, in line
    assert lost.id in await queue.pop(10)


async def test_intake_rides_out_a_long_confirm_wait_and_then_pushes_back() -> None:
    """RabbitMQ's confirms of persistent dispatches now and then take 100-200 ms (an fsync):
    at 100 submissions a second intake keeps admitting through such a wait (bound 8 once
    stopped it, a p99 of 100-200 ms); only MAX_SENDING admissions awaiting their confirms at
    once stop it, until one comes back. (Sent at once, as to a node a notification did not
    tell, or with SKED_DISPATCH_FOLLOW_S=0.)"""
    store = InMemoryStore()
    store.nodes.add("a", slots=MAX_SENDING + 1)
    queue, bus, hub = FakeReadyQueue(), GatedBus(), Hub()
    dispatcher = Dispatcher(AT_ONCE, store, bus, queue, hub)  # type: ignore[arg-type]
    intake = Intake(AT_ONCE, store, bus, queue, hub, dispatcher)  # type: ignore[arg-type]

    def submission(i: int) -> StubMessage:
        job = {"name": f"t{i}", "job": {"kind": "command", "argv": ["true"]}}
        return StubMessage(json.dumps(job).encode(), "submit", str(uuid4()))

    assert MAX_SENDING >= 20  # a 200 ms wait at 100 submissions a second
    for i in range(MAX_SENDING):
        await asyncio.wait_for(intake.accept([submission(i)]), 5)  # type: ignore[list-item]
    assert len(intake._sending) == MAX_SENDING
    blocked = asyncio.create_task(intake.accept([submission(MAX_SENDING)]))  # type: ignore[list-item]
    await asyncio.sleep(0.05)
    assert not blocked.done()  # backpressure: no more than MAX_SENDING in flight
    bus.gate.set()
    await asyncio.wait_for(blocked, 5)
    await asyncio.wait_for(asyncio.gather(*intake._sending), 5)
    assert len(dispatched(bus)) == MAX_SENDING + 1


async def test_intake_admits_a_batch_message_and_dead_letters_its_bad_tasks_alone() -> None:
    store = InMemoryStore()
    dispatcher, queue, bus, hub = scheduler_parts(store)
    intake = Intake(SETTINGS, store, bus, queue, hub, dispatcher)  # type: ignore[arg-type]
    good = {"name": "b", "job": {"kind": "command", "argv": ["true"]}}
    ids = [str(uuid4()) for _ in range(4)]
    tasks = [
        {"id": ids[0], "spec": good},
        {"id": ids[1], "spec": {**good, "max_retries": -1}},  # refused alone
        {"id": ids[2], "spec": {**good, "name": "c"}},
        {"id": ids[2], "spec": {**good, "name": "other"}},  # its id taken in this batch
        {"id": ids[3], "spec": good},
    ]
    messages = [
        StubMessage(json.dumps({"tasks": tasks}).encode(), "submit.batch", str(uuid4())),
        StubMessage(b'{"tasks": 7}', "submit.batch", str(uuid4())),  # refused whole
        StubMessage(json.dumps({**good, "name": "single"}).encode(), "submit", str(uuid4())),
    ]
    admitted = await intake.accept(messages)  # type: ignore[arg-type]
    assert sorted(str(t.id) for t in admitted if t.name != "single") == sorted(
        [ids[0], ids[2], ids[3]]
    )
    assert {t.name for t in admitted} == {"b", "c", "single"}
    dead = {json.loads(body).get("name"): why for body, why in bus.dead if body.startswith(b"{")}
    assert dead["b"].startswith("task 1 of a batch: ")
    assert dead["other"].startswith(f"its message id already names task {ids[2]}")
    assert any(
        why.startswith('a batch message must be an object with a non-empty list "tasks"')
        for _, why in bus.dead
    )
    assert len(bus.dead) == 3
    assert messages[-1].acked == 1  # one multiple-ack for all three messages


# -- executor ------------------------------------------------------------------------------


def executor_parts(store: InMemoryStore, backend: StubBackend) -> tuple[Node, Starter, Finisher]:
    node = Node(SETTINGS, store, StubBus(), backend, FakeReadyQueue(), asyncio.Event())  # type: ignore[arg-type]
    return node, Starter(node), Finisher(node)


def dispatch_of(task: Task) -> StubMessage:
    body = Dispatch.of(task, task.node or "n1")
    return StubMessage(body.model_dump_json().encode(), "n1")


async def scheduled(store: InMemoryStore) -> Task:
    task = await ready(store, spec("run"))
    return await store.walk(task, State.SCHEDULING, node="n1")


async def test_an_attempt_is_claimed_before_it_starts_and_starts_once() -> None:
    store, backend = InMemoryStore(), StubBackend(hold=True)
    node, starter, _ = executor_parts(store, backend)
    task = await scheduled(store)
    first, copy = dispatch_of(task), dispatch_of(task)
    assert await starter.start([first, copy]) == 1  # type: ignore[list-item]
    # the same attempt twice in a batch: one start, and both acknowledged (the claimed one
    # at its claim, the copy as a duplicate)
    assert first.acked + copy.acked == 2
    await asyncio.sleep(0)
    assert [lc.task_id for lc in backend.launched] == [task.id]
    running = await store.tasks.get(task.id)
    assert (running.status, running.lease_owner) == (State.RUNNING, node.boot_id)
    # delivered again later (a reconnect): it runs already, nothing starts twice
    assert await starter.start([dispatch_of(task)]) == 0  # type: ignore[list-item]
    backend.release((task.id, 1))
    await asyncio.wait(node.runs)
    assert len(backend.launched) == 1


async def test_a_dispatch_whose_task_moved_on_starts_nothing() -> None:
    store, backend = InMemoryStore(), StubBackend()
    _, starter, _ = executor_parts(store, backend)
    task = await scheduled(store)
    stale = dispatch_of(task)
    await store.walk(task, State.CANCELED)
    assert await starter.start([stale]) == 0  # type: ignore[list-item]
    assert backend.launched == []
    assert stale.acked == 1


async def test_a_dispatch_for_another_node_or_unreadable_is_dead_lettered() -> None:
    store, backend = InMemoryStore(), StubBackend()
    node, starter, _ = executor_parts(store, backend)
    elsewhere = dispatch_of(replace_node(await scheduled(store), "n2"))
    garbage = StubMessage(b'{"task_id": 1}', "n1")
    assert await starter.start([elsewhere, garbage]) == 0  # type: ignore[list-item]
    bus = node.bus
    assert isinstance(bus, StubBus)
    reasons = [why for _, why in bus.dead]
    assert reasons[0] == "a dispatch for node 'n2'"
    assert reasons[1].startswith("unreadable dispatch")
    assert backend.launched == []


async def test_a_batch_message_is_acknowledged_once_every_dispatch_in_it_is_settled() -> None:
    store, backend = InMemoryStore(), StubBackend(hold=True)
    node, starter, finisher = executor_parts(store, backend)
    runs, stale = await scheduled(store), await scheduled(store)
    elsewhere = replace_node(await scheduled(store), "n2")
    await store.walk(stale, State.CANCELED)
    body = pack([(Dispatch.of(t), {}) for t in (runs, stale, elsewhere)])
    message = StubMessage(body, "n1")
    assert await starter.start([message]) == 1  # type: ignore[list-item]
    bus = node.bus
    assert isinstance(bus, StubBus)
    [(dead, why)] = bus.dead  # the entry for another node alone, as its own JSON
    assert why == "a dispatch for node 'n2'"
    assert unpack(dead)[0].dispatch == Dispatch.of(elsewhere)
    # every entry settled (claimed, stale, dead-lettered): acknowledged while its attempt runs
    assert message.acked == 1
    await asyncio.sleep(0)
    backend.release((runs.id, 1))
    await asyncio.wait(node.runs)
    await finisher.finish([node.outcomes.get_nowait()])  # type: ignore[list-item]
    assert message.acked == 1  # once
    assert (await store.tasks.get(runs.id)).status is State.SUCCESS


async def test_held_dispatches_of_one_task_twice_go_back_to_ready_once() -> None:
    """A node holds a placement's notification and then its dispatch message: two items for
    one attempt, held side by side until a slot frees. Handed back (held too long, or the
    executor stopping), the task moves back to Ready once, both are settled, and the
    executor lives on (a batch moving a task twice was refused and stopped the executor)."""
    store, backend = InMemoryStore(), StubBackend()
    _, starter, _ = executor_parts(store, backend)
    task = await scheduled(store)
    told, message = dispatch_of(task), dispatch_of(task)
    starter.held.extend([*items_of(told), *items_of(message)])  # type: ignore[arg-type]
    await starter._hand_back_held(0.0)
    back = await store.tasks.get(task.id)
    assert back.status is State.READY
    assert back.version == task.version + 1
    assert told.acked + message.acked == 2
    assert not starter.held


def replace_node(task: Task, node: str) -> Task:
    from dataclasses import replace

    return replace(task, node=node)


async def test_an_outcome_whose_task_moved_on_is_kept_late_and_its_lease_given_back() -> None:
    store, backend = InMemoryStore(), StubBackend()
    node, _, finisher = executor_parts(store, backend)
    task = await scheduled(store)
    task = await store.walk(task, State.RUNNING, lease_owner=str(node.boot_id))
    await store.walk(task, State.PAUSED)
    late = await finisher.write([(Attempt(task, None), Report(ok=True, result=1))], [])  # type: ignore[arg-type]
    assert [t.id for t, _ in late] == [task.id]
    assert store.data.late == [(task.id, 1, True, 1, None, "attempt superseded on n1")]
    paused = await store.tasks.get(task.id)
    assert (paused.status, paused.lease_owner, paused.lease_until) == (State.PAUSED, None, None)


async def test_an_outcome_written_twice_after_a_lost_reply_is_not_late() -> None:
    store, backend = InMemoryStore(), StubBackend()
    node, _, finisher = executor_parts(store, backend)
    task = await scheduled(store)
    task = await store.walk(task, State.RUNNING, lease_owner=str(node.boot_id))
    batch = [(Attempt(task, None), Report(ok=False, error="exit code 3"))]  # type: ignore[arg-type]
    assert await finisher.write(batch, []) == []
    assert await finisher.write(batch, []) == []  # loses its CAS to itself: not late
    assert store.data.late == []
    assert (await store.tasks.get(task.id)).status is State.FAILED


# -- the heartbeat-monitor's ladder -------------------------------------------------------------


async def overdue(store: InMemoryStore) -> Task:
    store.nodes.add("n1")
    task = await scheduled(store)
    return await store.walk(task, State.RUNNING, lease_owner=str(uuid4()))


Answer = Callable[[str, bytes], bytes]  # (correlation id, probe) -> reply


def answer(state: str, report: Report | None = None) -> Answer:
    """The executor's answer, signed for the probe it answers (heartbeat.answer)."""

    def make(correlation_id: str, body: bytes) -> bytes:
        probe = heartbeat.Probe.model_validate_json(body)
        signed = heartbeat.answer(SECRET, correlation_id, probe, state, report)  # type: ignore[arg-type]
        return signed.model_dump_json().encode()

    return make


def forged(state: str, report: Report | None = None) -> bytes:
    return ProbeAnswer(state=state, report=report).model_dump_json().encode()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("said", "silent_s", "rung", "target"),
    [
        (answer("running"), 20.0, Rung.RESTORE, None),  # its lease still live (timeout 30 s)
        (answer("running"), 40.0, Rung.GRACE, None),  # its lease lapsed: as good as frozen
        (answer("finished", Report(ok=True, result=7)), 40.0, Rung.RECONCILE, State.SUCCESS),
        (answer("finished", Report(ok=False, error="x")), 40.0, Rung.RECONCILE, State.FAILED),
        (None, 40.0, Rung.GRACE, None),  # no answer from a live node: grace
        (answer("frozen"), 40.0, Rung.GRACE, None),  # frozen counts as no answer
        (None, 70.0, Rung.LOST, State.LOST),  # grace spent (timeout 30 s)
        (answer("unknown"), 40.0, Rung.LOST, State.LOST),
        (UNROUTABLE, 40.0, Rung.LOST, State.LOST),  # no executor connected: gone
        # an answer not signed for its probe is no answer
        (forged("finished", Report(ok=True, result=7)), 40.0, Rung.GRACE, None),
        (forged("unknown"), 40.0, Rung.GRACE, None),
    ],
)
async def test_the_ladder(said: object, silent_s: float, rung: Rung, target: State | None) -> None:
    store = InMemoryStore()
    task = await overdue(store)
    bus = StubBus(answers={"n1": said})
    ladder = Ladder(store, bus, probe_timeout_s=1.0, secret=SECRET)  # type: ignore[arg-type]
    got, move = await ladder.climb(task, silent_s, {n.id: n for n in await store.nodes.all()})
    assert got is rung
    assert (move.target if move else None) is target
    if rung is Rung.GRACE:
        assert store.leases.grace_given == [(task.id, task.attempt)]
    if said is UNROUTABLE:
        assert not store.data.nodes["n1"].ready  # out of placement at once
    if move is not None:
        assert "lease not renewed for" in move.reason


async def test_a_lost_verdict_loses_its_cas_while_the_lease_holds() -> None:
    store = InMemoryStore()
    task = await overdue(store)
    ladder = Ladder(store, StubBus(), probe_timeout_s=1.0, secret=SECRET)  # type: ignore[arg-type]
    _, move = await ladder.climb(task, 100.0, {})
    assert move is not None
    await ladder.apply([move])
    assert (await store.tasks.get(task.id)).status is State.RUNNING  # lease_until is ahead


def test_the_public_api_is_importable_from_sked() -> None:
    import sked

    assert sked.State.SUCCESS.label == "Success"
    assert sked.TaskSpec.parse({"name": "x", "job": {"kind": "command", "argv": ["true"]}})
    assert issubclass(sked.InvalidSpec, sked.SkedError)
    assert set(sked.__all__) <= set(dir(sked))


def test_only_a_workflow_tasks_end_wakes_workflow_resolution() -> None:
    """Resolution looks downstream of the tasks a notification marks as a workflow's; the
    ends of standalone tasks (almost all of them under load) do not wake it."""
    hub = Hub()
    hub.resolve_all = False
    plain, member = uuid4(), uuid4()
    hub.task_notify(None, 0, "", f"{plain}:4:success")
    assert not hub.resolve.is_set()
    assert hub.dispatch.is_set()  # the freed slot still wakes dispatch
    hub.task_notify(None, 0, "", f"{plain}:5:success {member}:4:w:failed")
    assert hub.resolve.is_set()
    assert hub.finished == {member}
    hub.resolve.clear()
    hub.task_notify(None, 0, "", "*:300:success")  # too many to list: look at all
    assert hub.resolve.is_set()
    assert hub.resolve_all


def test_the_ready_of_a_task_this_scheduler_admitted_wakes_no_dispatch() -> None:
    """Intake places what it admits or queues it and wakes dispatch itself: the Ready its own
    admission announces asks for nothing — at its admission's version only."""
    hub = Hub()
    mine = uuid4()
    hub.admitting({mine: 3})
    hub.task_notify(None, 0, "", f"{mine}:3:ready")
    assert not hub.dispatch.is_set()
    assert hub.ends == 0
    assert hub.admitted == {}  # heard: forgotten
    hub.task_notify(None, 0, "", f"{mine}:5:ready")  # later, its attempt came back to Ready
    assert hub.dispatch.is_set()
    assert hub.ends == 1


@pytest.mark.parametrize(
    "payload",
    [
        "{other}:3:ready",  # another scheduler's admission, or a retry
        "{mine}:4:ready",  # not the version its admission gave it
        "{mine}:3:ready {other}:7:success",  # a slot freed beside it
        "{mine}:3:ready not-a-task:1:ready",  # an entry that is not sked's
        "*:300:ready",  # too many to list
    ],
)
def test_any_other_ready_or_end_still_wakes_dispatch(payload: str) -> None:
    hub = Hub()
    mine, other = uuid4(), uuid4()
    hub.admitting({mine: 3})
    hub.task_notify(None, 0, "", payload.format(mine=mine, other=other))
    assert hub.dispatch.is_set()
    assert hub.ends == 1


def test_an_admission_too_big_for_its_notification_to_list_is_not_kept() -> None:
    hub = Hub()
    hub.admitting({uuid4(): 3 for _ in range(101)})
    assert hub.admitted == {}


def test_the_executor_suspects_its_attempts_only_on_moves_that_take_them_away() -> None:
    """An executor hears every transition's NOTIFY; only Paused, Canceled, Lost and RetryWait
    can take an attempt away, and the rest are skipped unparsed."""
    node, _, _ = executor_parts(InMemoryStore(), StubBackend())
    watcher = SimpleNamespace(node=node)  # the handler needs only the node (no lease link)
    notify = Watcher.on_task_notify
    mine, other = uuid4(), uuid4()
    node.active[(mine, 1)] = None  # type: ignore[assignment]
    for state in ("scheduling", "running", "success", "failed", "timed_out"):
        notify(watcher, None, 0, "", f"{mine}:3:{state} {other}:2:w:{state}")  # type: ignore[arg-type]
        assert not node.suspects
    notify(watcher, None, 0, "", f"{other}:3:running {mine}:4:w:canceled")  # type: ignore[arg-type]
    assert node.suspects == {mine}
    node.suspects.clear()
    notify(watcher, None, 0, "", "*:300:success,lost")  # type: ignore[arg-type]
    assert node.suspects == {mine}


async def test_a_message_of_more_dispatches_than_free_slots_starts_only_slots() -> None:
    """A superseded attempt on its way out still holds its slot: a dispatch message may then
    carry more attempts than are free, and the rest wait unclaimed for a slot — until the
    outcome holding it is written."""
    store, backend = InMemoryStore(), StubBackend(hold=True)
    settings = SETTINGS.model_copy(update={"slots": 2, "prefetch": 0, "finish_linger_s": 0})
    node = Node(settings, store, StubBus(), backend, FakeReadyQueue(), asyncio.Event())  # type: ignore[arg-type]
    starter = Starter(node)
    tasks = [await scheduled(store) for _ in range(3)]
    node.inbox.put_nowait(items_of(StubMessage(pack([(Dispatch.of(t), {}) for t in tasks]), "n1")))  # type: ignore[arg-type]
    loop = asyncio.create_task(starter.run())
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(backend.launched) == 2
    backend.release((backend.launched[0].task_id, 1))
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(backend.launched) == 2  # its outcome is known, not written: the slot is held
    finisher = asyncio.create_task(Finisher(node).run())
    for _ in range(40):
        await asyncio.sleep(0)
    assert len(backend.launched) == 3
    node.inbox.put_nowait(None)
    backend.release((backend.launched[1].task_id, 1))
    backend.release((backend.launched[2].task_id, 1))
    await loop
    await asyncio.wait(node.runs)
    node.outcomes.put_nowait(None)
    await finisher


async def test_with_a_backlog_only_slots_run_and_held_ones_start_as_slots_free() -> None:
    """SKED_PREFETCH: dispatches beyond the free slots wait unclaimed (their tasks stay
    Scheduling) and each starts the moment an attempt's outcome frees a slot."""
    store, backend = InMemoryStore(), StubBackend(hold=True)
    settings = SETTINGS.model_copy(update={"slots": 2, "prefetch": 2, "finish_linger_s": 0})
    node = Node(settings, store, StubBus(), backend, FakeReadyQueue(), asyncio.Event())  # type: ignore[arg-type]
    starter = Starter(node)
    assert node.gated
    tasks = [await scheduled(store) for _ in range(4)]
    for task in tasks:
        node.inbox.put_nowait(items_of(dispatch_of(task)))  # type: ignore[arg-type]
    loop = asyncio.create_task(starter.run())
    finisher = asyncio.create_task(Finisher(node).run())
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(backend.launched) == 2
    states = [(await store.tasks.get(t.id)).status for t in tasks]
    assert states.count(State.RUNNING) == 2
    assert states.count(State.SCHEDULING) == 2
    first = backend.launched[0]
    backend.release((first.task_id, first.attempt))
    for _ in range(40):
        await asyncio.sleep(0)
    assert len(backend.launched) == 3  # one outcome written: one held dispatch started
    assert node.running == 2
    # stopping hands the dispatch still held back to Ready
    node.inbox.put_nowait(None)
    node.stopping.set()
    await asyncio.wait_for(loop, 5)
    states = [(await store.tasks.get(t.id)).status for t in tasks]
    assert states.count(State.READY) == 1
    for launch in backend.launched[1:]:
        backend.release((launch.task_id, launch.attempt))
    await asyncio.wait(node.runs)
    node.outcomes.put_nowait(None)
    await finisher


def backlogged(slots: int, prefetch: int) -> tuple[InMemoryStore, StubBackend, Node]:
    store, backend = InMemoryStore(), StubBackend(hold=True)
    settings = SETTINGS.model_copy(
        update={"slots": slots, "prefetch": prefetch, "finish_linger_s": 0}
    )
    node = Node(settings, store, StubBus(), backend, FakeReadyQueue(), asyncio.Event())  # type: ignore[arg-type]
    return store, backend, node


def record_batches(store: InMemoryStore, fail_first: int = 0) -> list[list[State]]:
    """Each transition_many call's targets, in order; the first `fail_first` calls that mix
    ends and claims fail with a (non-transient) error."""
    batches: list[list[State]] = []
    transition_many = store.tasks.transition_many

    async def recorded(moves: Any) -> list[Task]:
        targets = [m.target for m in moves]
        batches.append(targets)
        nonlocal fail_first
        if fail_first and State.SUCCESS in targets and State.RUNNING in targets:
            fail_first -= 1
            raise ValueError("refused by the database")
        return await transition_many(moves)

    store.tasks.transition_many = recorded  # type: ignore[method-assign]
    return batches


async def settled(node: Node, launched: int, backend: StubBackend) -> None:
    for _ in range(200):
        if len(backend.launched) >= launched and not node.unreported:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(backend.launched)} launched, {len(node.unreported)} unwritten")


@pytest.mark.parametrize("refused", [0, 1])
async def test_a_held_dispatch_is_claimed_by_the_statement_that_frees_its_slot(
    refused: int,
) -> None:
    """An outcome's write and the claim of the held dispatch taking its slot are one
    statement (one commit), and the node never holds more than its slots. If that statement
    is refused, the outcome is written alone and the starter claims the dispatch after."""
    store, backend, node = backlogged(slots=2, prefetch=2)
    starter = Starter(node)
    tasks = [await scheduled(store) for _ in range(4)]
    for task in tasks:
        node.inbox.put_nowait(items_of(dispatch_of(task)))  # type: ignore[arg-type]
    batches = record_batches(store, fail_first=refused)
    loop = asyncio.create_task(starter.run())
    finisher = asyncio.create_task(Finisher(node, starter).run())
    await settled(node, 2, backend)
    assert batches == [[State.RUNNING, State.RUNNING]]  # two claimed, two held
    first = backend.launched[0]
    backend.release((first.task_id, first.attempt))
    await settled(node, 3, backend)
    if refused:
        assert batches[1:] == [[State.SUCCESS, State.RUNNING], [State.SUCCESS], [State.RUNNING]]
    else:
        assert batches[1:] == [[State.SUCCESS, State.RUNNING]]
    assert node.running == 2
    assert len(starter.held) == 1
    assert starter.claiming == 0
    assert (await store.tasks.get(first.task_id)).status is State.SUCCESS
    states = [(await store.tasks.get(t.id)).status for t in tasks]
    assert states.count(State.RUNNING) == 2
    assert states.count(State.SCHEDULING) == 1
    for launch in backend.launched[1:]:
        backend.release((launch.task_id, launch.attempt))
    await settled(node, 4, backend)
    backend.release((backend.launched[3].task_id, backend.launched[3].attempt))
    node.inbox.put_nowait(None)
    await asyncio.wait_for(loop, 5)
    if node.runs:
        await asyncio.wait_for(asyncio.wait(node.runs), 5)
    node.outcomes.put_nowait(None)
    await asyncio.wait_for(finisher, 5)
    assert {(await store.tasks.get(t.id)).status for t in tasks} == {State.SUCCESS}
    assert len(backend.launched) == 4  # each attempt started once


async def test_an_outcome_and_claim_retried_twice_start_the_attempt_once() -> None:
    """The joint statement's COMMIT went through but its reply was lost, and the look at the
    claim's task that follows failed too: each retry loses both CAS to the first try; the end
    is not late, the claim is recognised as this node's, its attempt starts once, and the
    slots it counted while being claimed are counted off once."""
    store, backend, node = backlogged(slots=1, prefetch=1)
    starter = Starter(node)
    first, second = await scheduled(store), await scheduled(store)
    assert await starter.start([dispatch_of(first)]) == 1  # type: ignore[list-item]
    await settled(node, 1, backend)
    backend.release((first.id, 1))
    await asyncio.wait_for(asyncio.wait(node.runs), 5)
    ended = node.outcomes.get_nowait()
    assert ended is not None
    starter.held.extend(items_of(dispatch_of(second)))  # type: ignore[arg-type]
    transition_many, get_many = store.tasks.transition_many, store.tasks.get_many
    calls = {"moves": 0, "reads": 0}

    async def reply_lost(moves: Any) -> list[Task]:
        calls["moves"] += 1
        moved = await transition_many(moves)
        if calls["moves"] == 1:
            raise ConnectionResetError("the COMMIT went through; its reply did not")
        return moved

    async def read_fails_once(ids: Any) -> list[Task]:
        calls["reads"] += 1
        if calls["reads"] == 1:
            raise ConnectionResetError("Postgres went away")
        return await get_many(ids)

    store.tasks.transition_many = reply_lost  # type: ignore[method-assign]
    store.tasks.get_many = read_fails_once  # type: ignore[method-assign]
    await asyncio.wait_for(Finisher(node, starter).finish([ended]), 10)
    assert calls == {"moves": 3, "reads": 2}
    assert (await store.tasks.get(first.id)).status is State.SUCCESS
    assert store.data.late == []  # its own end, applied by the first try: not a late result
    assert list(node.active) == [(second.id, 1)]
    assert starter.claiming == 0
    assert not starter.held
    await asyncio.sleep(0)
    assert [lc.task_id for lc in backend.launched] == [first.id, second.id]  # each once


async def test_a_held_dispatch_of_a_task_ending_in_the_batch_stays_held() -> None:
    """One statement moves a task once: a held newer attempt of a task whose older attempt's
    outcome is being written is not claimed with it (the starter claims it after)."""
    store, _backend, node = backlogged(slots=1, prefetch=1)
    starter = Starter(node)
    task = await scheduled(store)
    item = dispatch_of(task)
    starter.held.extend(items_of(item))  # type: ignore[arg-type]
    ending = {task.id}
    assert await starter.claimable(1, ending) == []
    assert len(starter.held) == 1
    assert starter.claiming == 0
    claims = await starter.claimable(1, set())
    assert [d.task_id for d, _ in claims] == [task.id]
    assert starter.claiming == 1
    starter.unclaimed(claims)
    assert len(starter.held) == 1
    assert starter.claiming == 0


async def test_the_finish_batch_waits_for_running_attempts_and_no_longer() -> None:
    """An outcome waits up to the finish linger for others to join its batch, but only while an
    attempt here still runs: the last one to end sends the batch at once, whole."""
    store, backend = InMemoryStore(), StubBackend(hold=True)
    settings = SETTINGS.model_copy(update={"slots": 3, "prefetch": 0, "finish_linger_s": 60})
    node = Node(settings, store, StubBus(), backend, FakeReadyQueue(), asyncio.Event())  # type: ignore[arg-type]
    batches: list[list[State]] = []
    transition_many = store.tasks.transition_many

    async def recorded(moves: Any) -> list[Task]:
        batches.append([m.target for m in moves])
        return await transition_many(moves)

    tasks = [await scheduled(store) for _ in range(3)]
    store.tasks.transition_many = recorded  # type: ignore[method-assign]
    assert await Starter(node).start([dispatch_of(t) for t in tasks]) == 3  # type: ignore[misc]
    finisher = asyncio.create_task(Finisher(node).run())
    for _ in range(20):
        await asyncio.sleep(0)
    for launch in backend.launched[:2]:
        backend.release((launch.task_id, launch.attempt))
    for _ in range(40):
        await asyncio.sleep(0)
    assert len(batches) == 1  # the claim only: two outcomes wait for the third attempt
    assert node.running == 3
    last = backend.launched[2]
    backend.release((last.task_id, last.attempt))
    await asyncio.wait_for(asyncio.wait(node.runs), 5)
    for _ in range(40):
        await asyncio.sleep(0)
    assert batches[1:] == [[State.SUCCESS] * 3]  # at once, not after the 60 s linger
    assert node.running == 0
    node.outcomes.put_nowait(None)
    await asyncio.wait_for(finisher, 5)
