"""The producer SDK: submit tasks over RabbitMQ, read them and wait for them in Postgres.

    from shared.client import SkedClient

    async with SkedClient() as sked:          # reads SKED_* like every sked process
        task_id = await sked.submit({"name": "hello", "job": {"kind": "command",
                                                               "argv": ["echo", "hi"]}})
        task = await sked.wait(task_id)

`submit` returns as soon as RabbitMQ has confirmed the message: the task id is chosen here (the
message id), so a redelivered submission can never become a second task. Code without an event
loop uses shared.sync_client.SyncSkedClient, the same calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any
from uuid import UUID, uuid4

from shared.client_control import Control
from shared.errors import InvalidSpec, NotFound, Purged, SkedError, missing
from shared.fsm import ENDING, State
from shared.models import Event, Task, TaskSpec, task_id_for
from shared.rendering import rendered
from shared.settings import Settings
from shared.views import WorkflowSummary, WorkflowView

if TYPE_CHECKING:  # imported by the calls that use them: reading a task needs only the store
    from datetime import datetime

    from redis.asyncio import Redis

    from shared.bus import AmqpBus
    from shared.dag import WorkflowSpec
    from shared.dead_letters import DeadLetter
    from shared.queues import ReadyQueue
    from shared.store import NodeRow, Store


def deadline_of(timeout: float | None) -> float | None:
    """When a wait of `timeout` seconds gives up (monotonic; None: never). NaN is refused: no
    deadline compares past it, so the wait would never end; infinity (or an integer past any
    float) is as long as forever."""
    if timeout is None:
        return None
    if timeout != timeout:
        raise InvalidSpec("a timeout must be a number of seconds, not NaN")
    try:
        seconds = float(timeout)
    except OverflowError:
        return None
    if math.isinf(seconds):
        return None if seconds > 0 else time.monotonic()
    return time.monotonic() + seconds


class WaitTimeout(SkedError, TimeoutError):
    def __init__(self, pending: Iterable[UUID], timeout: float) -> None:
        ids = ", ".join(str(i) for i in pending)
        super().__init__(f"not terminal after {timeout:g} s: {ids}")


# How many ids of keyed submissions a client remembers (`SkedClient._keyed`): ~100 bytes each.
KEYED_KEPT = 10_000


class SkedClient(Control):
    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self._bus: AmqpBus | None = None
        self._store: Store | None = None
        self._redis: Redis | None = None
        # ids of keyed tasks this client submitted, latest last (at most KEYED_KEPT): a key
        # retention freed names the same id as the task it deleted, whose tombstone must not
        # end a wait for the new one before intake admits it
        self._keyed: dict[UUID, None] = {}

    async def __aenter__(self) -> SkedClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
        if self._bus is not None:
            await self._bus.close()
            self._bus = None
        if self._store is not None:
            await self._store.close()
            self._store = None

    async def _db(self) -> Store:
        if self._store is None:
            from shared.store import Store

            s = self.settings
            self._store = await Store.connect(s.database_url, 2, s.lease_margin_s, s.node_ttl_s)
        return self._store

    def _queue(self) -> ReadyQueue:
        from shared.queues import ReadyQueue, connect

        if self._redis is None:
            self._redis = connect(self.settings.redis_url)
        return ReadyQueue(self._redis, self.settings.aging_s)

    async def _publisher(self) -> AmqpBus:
        from shared.bus import AmqpBus

        if self._bus is None:
            bus = AmqpBus(self.settings.rabbitmq_url, self.settings.dead_max)
            await bus.connect()
            self._bus = bus
        return self._bus

    async def _publish(
        self, routing_key: str, bodies: Sequence[tuple[bytes, UUID, str]], batch: bool = False
    ) -> None:
        """Publish (body, id, name) submissions to sked.tasks, each under a PRODUCER span rooting
        its trace; the id is the message id, so a redelivery is one task. batch: packed into
        `submit.batch` messages (a message per task was most of what a submission cost)."""
        from opentelemetry.trace import SpanKind

        from shared import telemetry
        from shared.bus import BATCH_KEY, SCHEMA_HEADER, TASKS_EXCHANGE, Outgoing
        from shared.intake import BATCH_BYTES, pack_batches

        bus = await self._publisher()
        spans = [
            telemetry.start(
                f"{TASKS_EXCHANGE} publish",
                kind=SpanKind.PRODUCER,
                attributes=telemetry.messaging(TASKS_EXCHANGE, "publish", ident, task_name=name),
            )
            for _, ident, name in bodies
        ]
        try:
            heads = [telemetry.headers_for(span, {SCHEMA_HEADER: 1}) for span in spans]
            sent = [(b, i, h) for (b, i, _), h in zip(bodies, heads, strict=True)]
            if batch:
                limit = min(BATCH_BYTES, self.settings.max_message_bytes // 2)
                packed = pack_batches([(b, i, h.get("traceparent")) for b, i, h in sent], limit)
                messages = [
                    Outgoing(BATCH_KEY, b, {SCHEMA_HEADER: 1}, str(uuid4())) for b in packed
                ]
            else:
                messages = [Outgoing(routing_key, b, h, str(i)) for b, i, h in sent]
            await bus.publish(TASKS_EXCHANGE, messages)
        finally:
            for span in spans:
                span.end()

    # -- submit -------------------------------------------------------------------------------

    async def submit(self, spec: TaskSpec | dict[str, Any]) -> UUID:
        """Publish one task; returns its id once RabbitMQ confirmed the message."""
        return (await self.submit_many([spec]))[0]

    async def submit_many(self, specs: Sequence[TaskSpec | dict[str, Any]]) -> list[UUID]:
        """Publish many tasks (in batch messages, all confirms in flight at once); returns their
        ids in order. Specs are validated here first: a bad one raises InvalidSpec, none sent."""
        from shared.bus import SUBMIT_KEY

        # a TaskSpec built by its constructor skipped what only a submission is held to
        # (NEW): judged again from its JSON, as intake will
        parsed = [
            TaskSpec.parse(s.model_dump(mode="json") if isinstance(s, TaskSpec) else s)
            for s in specs
        ]
        limit = self.settings.max_message_bytes
        bodies = [(rendered(s, limit), task_id_for(s), s.name) for s in parsed]
        await self._publish(SUBMIT_KEY, bodies, batch=len(bodies) > 1)
        for spec, (_, ident, _) in zip(parsed, bodies, strict=True):
            if spec.idempotency_key is not None:
                self._keyed.pop(ident, None)
                self._keyed[ident] = None
        while len(self._keyed) > KEYED_KEPT:
            del self._keyed[next(iter(self._keyed))]
        return [ident for _, ident, _ in bodies]

    async def submit_workflow(self, spec: WorkflowSpec | dict[str, Any]) -> UUID:
        """Publish a whole workflow (validated here first: a cycle raises InvalidSpec naming
        it, and nothing is sent); returns its id once RabbitMQ confirmed the message."""
        from shared.bus import WORKFLOW_KEY
        from shared.dag import WorkflowSpec

        parsed = WorkflowSpec.parse(
            spec.model_dump(mode="json") if isinstance(spec, WorkflowSpec) else spec
        )  # one built by its constructor was never checked (a cycle, an unknown edge)
        workflow_id = uuid4()
        body = rendered(parsed, self.settings.max_message_bytes)
        await self._publish(WORKFLOW_KEY, [(body, workflow_id, parsed.name)])
        return workflow_id

    async def workflow(self, workflow_id: UUID | str) -> WorkflowView:
        row, tasks, edges = await (await self._db()).workflows.get(UUID(str(workflow_id)))
        return WorkflowView(
            row["id"],
            row["name"],
            tasks,
            [(e["upstream_id"], e["task_id"], e["condition"]) for e in edges],
        )

    async def wait_workflow(
        self, workflow_id: UUID | str, timeout: float | None = None
    ) -> WorkflowView:
        """Wait until every task of the workflow is terminal."""
        deadline = deadline_of(timeout)
        view = await self._workflow_when_admitted(UUID(str(workflow_id)), timeout)
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        await self.wait_all([t.id for t in view.tasks], left)
        return await self.workflow(workflow_id)

    async def _workflow_when_admitted(
        self, workflow_id: UUID, timeout: float | None
    ) -> WorkflowView:
        deadline = deadline_of(timeout)
        while True:
            try:
                return await self.workflow(workflow_id)
            except Purged:
                raise
            except NotFound:
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeout([workflow_id], timeout or 0) from None
                await asyncio.sleep(0.05)  # its submission is still on its way

    # -- read ---------------------------------------------------------------------------------

    async def get(self, task_id: UUID | str) -> Task:
        return await (await self._db()).tasks.get(ident_of(task_id))

    async def log(self, task_id: UUID | str, timeout: float = 5.0) -> str | None:
        """The task's log: while an attempt runs, as it is now, asked of its executor (a
        pod's log on Kubernetes, the process's log file locally); else the tail stored when
        the attempt ended. None if there is none yet. The live log is taken only from an
        answer its executor signed (whoever may read `sked.probe` could answer first, with a
        log of their own): without SKED_HEARTBEAT_SECRET to check it by, the stored tail."""
        task = await self.get(task_id)
        try:
            secret = self.settings.require_heartbeat_secret()
        except ValueError:
            secret = ""
        if task.status is State.RUNNING and task.node is not None and secret:
            from shared import heartbeat
            from shared.bus import PROBE_EXCHANGE

            probe = heartbeat.Probe(task_id=task.id, attempt=task.attempt, want="log")
            cid = uuid4().hex
            check = heartbeat.believer(secret, cid, probe)
            bus = await self._publisher()
            body = probe.model_dump_json().encode()
            got = await bus.request(PROBE_EXCHANGE, task.node, body, timeout, cid, check)
            if isinstance(got, bytes):
                live = heartbeat.believe(secret, cid, probe, got).log
                if live is not None:
                    return live
        return task.log_tail

    async def history(self, task_id: UUID | str) -> list[Event]:
        return await (await self._db()).tasks.history(ident_of(task_id))

    async def tasks(
        self,
        statuses: Iterable[object] | None = None,
        limit: int = 100,
        after: UUID | None = None,
        name: str | None = None,
    ) -> list[Task]:
        """Tasks, newest first, optionally only those in `statuses` or of `name`; `after` (the
        last task of the page before) gives the next page."""
        return await (await self._db()).tasks.list_tasks(statuses, name, page_size(limit), after)

    async def workflows(
        self, limit: int = 100, after: UUID | None = None, name: str | None = None
    ) -> list[WorkflowSummary]:
        """Workflows, newest first, each with its status and tasks counted; `after` (the last
        of the page before) gives the next page."""
        return await (await self._db()).workflows.page(page_size(limit), after, name)

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        """The oldest submissions intake refused (sked.dead), each with its reason; left where
        they are."""
        return await (await self._publisher()).peek_dead(page_size(limit))

    async def nodes(self) -> list[NodeRow]:
        """The registered nodes with their capacity and usage."""
        return await (await self._db()).nodes.all()

    async def wait(self, task_id: UUID | str, timeout: float | None = None) -> Task:
        """Wait until the task is terminal; returns it. Raises WaitTimeout."""
        return (await self.wait_all([task_id], timeout))[ident_of(task_id)]

    async def wait_all(
        self, task_ids: Iterable[UUID | str], timeout: float | None = None
    ) -> dict[UUID, Task]:
        """Wait until every task is terminal.

        Woken by the state-change NOTIFY that moves some task into a state it can end in: it
        checks only the tasks it names (all pending ones after a batch too big to list), and
        all once a second in case one was missed. A task not yet created counts as pending.
        """
        from shared.resilience import TRANSIENT
        from shared.store import TASK_CHANNEL, parse_notify
        from shared.store.notify import may_name

        store = await self._db()
        if isinstance(task_ids, str | bytes | UUID):
            raise InvalidSpec("wait_all takes a collection of task ids, not one id")
        pending = {ident_of(i) for i in task_ids}
        done: dict[UUID, Task] = {}
        wake = asyncio.Event()
        named: set[UUID] = set()  # ids named by notifications since the last check
        check_all = True
        deadline = deadline_of(timeout)

        def notified(_c: object, _p: int, _ch: str, payload: str) -> None:
            nonlocal check_all
            if not may_name(payload, ENDING):  # a Ready, Scheduling or Running: nobody ended
                return
            notice = parse_notify(payload)
            if notice.ids is None:
                check_all = True
            else:
                named.update(notice.ids & pending)
            if check_all or named:
                wake.set()

        def reconnected() -> None:
            nonlocal check_all
            check_all = True  # notifications were missed while LISTEN was down
            wake.set()

        stop = asyncio.Event()
        listener = store.listener([(TASK_CHANNEL, notified)], reconnected)
        listening = asyncio.create_task(listener.run(stop))
        try:
            last_full = time.monotonic()
            while True:
                wake.clear()
                full = check_all or time.monotonic() - last_full >= 1.0
                if full:
                    check, check_all, last_full = list(pending), False, time.monotonic()
                else:
                    check = list(named & pending)
                named.clear()
                gone: dict[UUID, datetime] = {}
                try:
                    finished = await store.tasks.terminal_among(check)
                    if full:  # a task retention deleted never ends: say so (not one
                        # this client submitted again: it is on its way to intake)
                        kept = [i for i in check if i not in self._keyed]
                        gone = await store.retention.tasks_purged(kept)
                except TRANSIENT:  # Postgres is away: wait and look at everything again
                    check_all = True
                    finished = []
                for task in finished:
                    done[task.id] = task
                    pending.discard(task.id)
                if not pending:
                    return done
                if gone:
                    first, at = min(gone.items(), key=lambda kv: kv[1])
                    more = f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""
                    raise missing("task", f"{first}{more}", at)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeout(pending, timeout or 0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), min(1.0, left or 1.0))
        finally:
            stop.set()
            await listening


def ident_of(ident: UUID | str, what: str = "task") -> UUID:
    """An id as a UUID, or InvalidSpec naming what was given: never text spliced into a
    request's path or a query."""
    try:
        return ident if isinstance(ident, UUID) else UUID(str(ident))
    except (ValueError, TypeError):
        raise InvalidSpec(f"not a {what} id: {str(ident)[:100]!r}") from None


def page_size(limit: int) -> int:
    """A listing's size: 1 to 1,000, as the operator API's (else InvalidSpec)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise InvalidSpec(f"a limit is an integer from 1 to 1,000: {limit!r}")
    return limit
