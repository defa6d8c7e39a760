"""A client of the operator API (services/api) with the calls the CLI makes of SkedClient: the
same names, arguments and return types, over HTTP with a bearer token instead of straight to
Postgres and RabbitMQ. The CLI uses it when SKED_API_URL and SKED_API_TOKEN are both set.

    async with ApiClient("http://127.0.0.1:8480", token) as sked:
        task = await sked.get(await sked.submit({"name": "hi", "job": {...}}))

Errors come back as SkedClient's would: NotFound (404), NotAllowed (409), InvalidSpec (400);
a refused token (401, 403) or anything else as SkedError with the API's message. Waiting polls
the task (the API has no push), a few times a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import typing
from collections.abc import Iterable, Mapping
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any
from uuid import UUID

import aiohttp

from shared import fsm
from shared.client import WaitTimeout
from shared.errors import InvalidSpec, NotFound, Purged, SkedError
from shared.fsm import State
from shared.models import Event, Task, TaskSpec
from shared.views import WorkflowSummary, WorkflowView

# The store's modules (NodeRow, Drain, NotAllowed) and the workflow models are imported by the
# calls that need them: `sked status` through the API needs no database library at all.
if TYPE_CHECKING:
    from shared.bus import DeadLetter
    from shared.cordon import Drain
    from shared.dag import WorkflowSpec
    from shared.store import NodeRow

POLL_S = (0.1, 1.0)  # a wait polls from every 0.1 s, slowing to every second


class ApiRefused(SkedError):
    """The API refused the token (401: none, unknown or revoked; 403: its role is too low)."""


ERRORS: dict[int, type[SkedError]] = {
    400: InvalidSpec,
    401: ApiRefused,
    403: ApiRefused,
    404: NotFound,
    410: Purged,
    # 409: shared.control.NotAllowed (see error_for)
}


def error_for(status: int) -> type[SkedError]:
    """The error SkedClient would raise for this HTTP status."""
    if status == 409:  # imported only then: shared.control loads the store
        from shared.control import NotAllowed

        return NotAllowed
    return ERRORS.get(status, SkedError)


def from_json(cls: type[Any], data: Mapping[str, Any], **given: Any) -> Any:
    """A row dataclass (Task, NodeRow) back from its `as_json()`: datetimes, UUIDs and states
    parsed by the field's type; `given` fields are taken as they are."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in values or f.name not in data:
            continue
        value, kinds = data[f.name], typing.get_args(hints[f.name]) or (hints[f.name],)
        if value is not None:
            if datetime in kinds:
                value = datetime.fromisoformat(value)
            elif UUID in kinds:
                value = UUID(value)
            elif State in kinds:
                value = State(value)
        values[f.name] = value
    return cls(**values)


def task_of(data: Mapping[str, Any]) -> Task:
    task: Task = from_json(Task, data, spec_json=json.dumps(data["spec"]))
    return task


def node_of(data: Mapping[str, Any]) -> NodeRow:
    from shared.store import NodeRow

    node: NodeRow = from_json(NodeRow, data)
    return node


class ApiClient:
    def __init__(self, url: str, token: str, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.token = token
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ApiClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(
        self, method: str, path: str, body: Any = None, timeout: float | None = None, **query: Any
    ) -> Any:
        """One request; the decoded JSON answer, or the error as SkedClient would raise it."""
        if self._session is None:
            self._session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"})
        params = [
            (k, str(v))
            for k, vs in query.items()
            if vs is not None
            for v in (vs if isinstance(vs, list) else [vs])
        ]
        wait = aiohttp.ClientTimeout(total=timeout or self.timeout)
        try:
            async with self._session.request(
                method, f"{self.url}{path}", json=body, params=params, timeout=wait
            ) as r:
                text = await r.text()
                data = json.loads(text) if text else None
                status = r.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise SkedError(f"the API at {self.url} did not answer: {exc}") from None
        if status >= 400:
            message = data.get("error") if isinstance(data, dict) else text
            raise error_for(status)(f"{message} (HTTP {status})")
        return data

    # -- submit -------------------------------------------------------------------------------

    async def submit(self, spec: TaskSpec | dict[str, Any]) -> UUID:
        parsed = spec if isinstance(spec, TaskSpec) else TaskSpec.parse(spec)
        return UUID((await self.call("POST", "/v1/tasks", parsed.model_dump(mode="json")))["id"])

    async def submit_workflow(self, spec: WorkflowSpec | dict[str, Any]) -> UUID:
        from shared.dag import WorkflowSpec

        parsed = spec if isinstance(spec, WorkflowSpec) else WorkflowSpec.parse(spec)
        body = parsed.model_dump(mode="json")
        return UUID((await self.call("POST", "/v1/workflows", body))["id"])

    # -- read ---------------------------------------------------------------------------------

    async def get(self, task_id: UUID | str) -> Task:
        return task_of(await self.call("GET", f"/v1/tasks/{task_id}"))

    async def tasks(
        self,
        statuses: Iterable[object] | None = None,
        limit: int = 100,
        after: UUID | None = None,
        name: str | None = None,
    ) -> list[Task]:
        wanted = None if statuses is None else [State.parse(s).value for s in statuses]
        found = await self.call(
            "GET", "/v1/tasks", status=wanted, limit=limit, after=after, name=name
        )
        return [task_of(t) for t in found]

    async def workflows(
        self, limit: int = 100, after: UUID | None = None, name: str | None = None
    ) -> list[WorkflowSummary]:
        found = await self.call("GET", "/v1/workflows", limit=limit, after=after, name=name)
        return [from_json(WorkflowSummary, w) for w in found]

    async def history(self, task_id: UUID | str) -> list[Event]:
        events = await self.call("GET", f"/v1/tasks/{task_id}/events")
        return [Event.model_validate(e) for e in events]

    async def log(self, task_id: UUID | str, timeout: float = 5.0) -> str | None:
        answer = await self.call("GET", f"/v1/tasks/{task_id}/logs", timeout=timeout + 30)
        text: str | None = answer["log"]
        return text

    async def workflow(self, workflow_id: UUID | str) -> WorkflowView:
        data = await self.call("GET", f"/v1/workflows/{workflow_id}")
        edges = [(UUID(e["upstream"]), UUID(e["task"]), e["condition"]) for e in data["edges"]]
        return WorkflowView(
            UUID(data["id"]), data["name"], [task_of(t) for t in data["tasks"]], edges
        )

    async def nodes(self) -> list[NodeRow]:
        return [node_of(n) for n in await self.call("GET", "/v1/nodes")]

    # -- control ------------------------------------------------------------------------------

    async def pause(self, task_id: UUID | str, reason: str, by: str | None = None) -> Task:
        body = {"reason": reason, "by": by}
        return task_of(await self.call("POST", f"/v1/tasks/{task_id}/pause", body))

    async def resume(self, task_id: UUID | str, by: str | None = None) -> Task:
        return task_of(await self.call("POST", f"/v1/tasks/{task_id}/resume", {"by": by}))

    async def cancel(self, task_id: UUID | str, reason: str = "", by: str | None = None) -> Task:
        body = {"reason": reason, "by": by}
        return task_of(await self.call("POST", f"/v1/tasks/{task_id}/cancel", body))

    async def cancel_workflow(
        self, workflow_id: UUID | str, reason: str = "", by: str | None = None
    ) -> list[Task]:
        return await self._workflow_control(workflow_id, "cancel", {"reason": reason, "by": by})

    async def pause_workflow(
        self, workflow_id: UUID | str, reason: str, by: str | None = None
    ) -> list[Task]:
        return await self._workflow_control(workflow_id, "pause", {"reason": reason, "by": by})

    async def resume_workflow(self, workflow_id: UUID | str, by: str | None = None) -> list[Task]:
        return await self._workflow_control(workflow_id, "resume", {"by": by})

    async def _workflow_control(
        self, workflow_id: UUID | str, action: str, body: dict[str, Any]
    ) -> list[Task]:
        moved = await self.call("POST", f"/v1/workflows/{workflow_id}/{action}", body)
        return [task_of(t) for t in moved]

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        from shared.bus import DeadLetter

        return [from_json(DeadLetter, d) for d in await self.call("GET", "/v1/dead", limit=limit)]

    async def set_priority(self, task_id: UUID | str, priority: int) -> list[Task]:
        body = {"priority": priority}
        return [task_of(t) for t in await self.call("POST", f"/v1/tasks/{task_id}/priority", body)]

    async def cordon(self, node_id: str, reason: str = "") -> NodeRow:
        return node_of(await self.call("POST", f"/v1/nodes/{node_id}/cordon", {"reason": reason}))

    async def uncordon(self, node_id: str) -> NodeRow:
        return node_of(await self.call("POST", f"/v1/nodes/{node_id}/uncordon"))

    async def drain(self, node_id: str, timeout: float | None = None, reason: str = "") -> Drain:
        """Cordon, then wait up to `timeout` s (None: until drained), asking the API to wait
        up to 10 minutes at a time."""
        from shared.cordon import Drain

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 600.0 if deadline is None else max(0.0, min(600.0, deadline - time.monotonic()))
            path, body = f"/v1/nodes/{node_id}/drain", {"reason": reason}
            data = await self.call("POST", path, body, timeout=left + 30, wait=round(left, 3))
            done = Drain(node_of(data["node"]), [UUID(i) for i in data["holding"]])
            if done.done or (deadline is not None and time.monotonic() >= deadline):
                return done

    # -- wait ---------------------------------------------------------------------------------

    async def wait(self, task_id: UUID | str, timeout: float | None = None) -> Task:
        return (await self.wait_all([task_id], timeout))[UUID(str(task_id))]

    async def wait_all(
        self, task_ids: Iterable[UUID | str], timeout: float | None = None
    ) -> dict[UUID, Task]:
        """Poll until every task is terminal. A task not yet admitted counts as pending."""
        pending = {UUID(str(i)) for i in task_ids}
        done: dict[UUID, Task] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = POLL_S[0]
        while True:
            for task_id in sorted(pending):
                try:
                    task = await self.get(task_id)
                except Purged:
                    raise
                except NotFound:
                    continue  # its submission is still on its way
                if fsm.is_terminal(task.status, fsm.has_retry_left(task)):
                    done[task_id] = task
                    pending.discard(task_id)
            if not pending:
                return done
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(pending, timeout or 0)
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, POLL_S[1])

    async def wait_workflow(
        self, workflow_id: UUID | str, timeout: float | None = None
    ) -> WorkflowView:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                view = await self.workflow(workflow_id)
                break
            except Purged:
                raise
            except NotFound:
                if deadline is not None and time.monotonic() > deadline:
                    raise
                await asyncio.sleep(POLL_S[0])
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        await self.wait_all([t.id for t in view.tasks], left)
        return await self.workflow(workflow_id)
