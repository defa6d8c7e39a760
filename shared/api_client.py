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
import functools
import time
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote
from uuid import UUID

import aiohttp

from shared import fsm, jsonvalue
from shared.api_answers import (
    drain_of,
    from_json,
    node_of,
    read_answer,
    task_of,
)
from shared.client import WaitTimeout, deadline_of, ident_of
from shared.errors import InvalidSpec, NotAllowed, NotFound, Purged, SkedError
from shared.fsm import State
from shared.models import Event, Task, TaskSpec
from shared.redact import masked, printable
from shared.views import WorkflowSummary, WorkflowView

# The store's modules (NodeRow, Drain, NotAllowed) and the workflow models are imported by the
# calls that need them: `sked status` through the API needs no database library at all.
if TYPE_CHECKING:
    from shared.cordon import Drain
    from shared.dag import WorkflowSpec
    from shared.dead_letters import DeadLetter
    from shared.store import NodeRow

T = TypeVar("T")
POLL_S = (0.1, 1.0)  # a wait polls from every 0.1 s, slowing to every second
# The largest answer read, decoded (a listing of 1,000 tasks is a few MB): a broken or hostile
# server's endless or compressed body is refused past it, not read into memory.
MAX_ANSWER_BYTES = 8 * 1024 * 1024


class ApiRefused(SkedError):
    """The API refused the token (401: none, unknown or revoked; 403: its role is too low)."""


FIRST_LOOK_S = 1.0  # what a wait with no time left has for its one round of asking


class ApiUnavailable(SkedError):
    """The API did not answer, or answered that it cannot now (502, 503, 504): a wait
    polls on through it, as SkedClient's does through a brief loss of Postgres."""


ERRORS: dict[int, type[SkedError]] = {
    400: InvalidSpec,
    401: ApiRefused,
    403: ApiRefused,
    404: NotFound,
    409: NotAllowed,
    410: Purged,
    502: ApiUnavailable,
    503: ApiUnavailable,
    504: ApiUnavailable,
}


def error_for(status: int) -> type[SkedError]:
    """The error SkedClient would raise for this HTTP status."""
    return ERRORS.get(status, SkedError)


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
                method,
                f"{self.url}{path}",
                json=body,
                params=params,
                timeout=wait,
                allow_redirects=False,  # a redirect elsewhere would get the spec (and answer)
            ) as r:
                status = r.status
                # to its end, bounded: read(n) gives what is buffered, which cut every answer
                # past a socket read (~64 KB: a page of 50 tasks) into "not JSON"
                raw = bytearray()
                async for chunk in r.content.iter_chunked(64 * 1024):
                    raw += chunk
                    if len(raw) > MAX_ANSWER_BYTES:
                        break
        except (aiohttp.ClientSSLError, aiohttp.InvalidURL) as exc:  # no retry mends these
            raise SkedError(f"the API at {masked(self.url)} cannot be reached: {exc}") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise ApiUnavailable(f"the API at {masked(self.url)} did not answer: {exc}") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise SkedError(f"the API at {masked(self.url)} did not answer: {exc}") from None
        if len(raw) > MAX_ANSWER_BYTES:
            raise SkedError(f"the API answered {path} with over {MAX_ANSWER_BYTES} bytes")
        text = raw.decode("utf-8", "replace")
        try:  # intake's strict reader: no NaN, no nesting past what sked stores
            data = jsonvalue.parse(bytes(raw)) if raw else None
        except ValueError:
            if status < 400:
                raise SkedError(f"the API answered {path} with a body that is not JSON") from None
            data = None
        if 300 <= status < 400:
            raise SkedError(f"the API redirected {path} (HTTP {status}): not followed")
        if status >= 400:
            found = data.get("error") if isinstance(data, dict) else None
            message = found if isinstance(found, str) else text
            raise error_for(status)(f"{printable(message[:300])} (HTTP {status})")
        return data

    # -- submit -------------------------------------------------------------------------------

    async def submit(self, spec: TaskSpec | dict[str, Any]) -> UUID:
        parsed = TaskSpec.parse(
            spec.model_dump(mode="json") if isinstance(spec, TaskSpec) else spec
        )
        answer = await self.call("POST", "/v1/tasks", parsed.model_dump(mode="json"))
        return read_answer("/v1/tasks", lambda: UUID(answer["id"]))

    async def submit_workflow(self, spec: WorkflowSpec | dict[str, Any]) -> UUID:
        from shared.dag import WorkflowSpec

        parsed = WorkflowSpec.parse(
            spec.model_dump(mode="json") if isinstance(spec, WorkflowSpec) else spec
        )
        body = parsed.model_dump(mode="json")
        answer = await self.call("POST", "/v1/workflows", body)
        return read_answer("/v1/workflows", lambda: UUID(answer["id"]))

    # -- read ---------------------------------------------------------------------------------

    async def get(self, task_id: UUID | str) -> Task:
        return await self._get(task_id)

    async def _get(self, task_id: UUID | str, timeout: float | None = None) -> Task:
        asked = ident_of(task_id)
        path = f"/v1/tasks/{asked}"
        answer = await self.call("GET", path, timeout=timeout)
        task = read_answer(path, lambda: task_of(answer))
        if task.id != asked:  # a misrouting proxy or cache, or a hostile server
            raise SkedError(f"the API answered {path} about another task ({task.id})")
        return task

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
        return read_answer("/v1/tasks", lambda: [task_of(t) for t in found])

    async def workflows(
        self, limit: int = 100, after: UUID | None = None, name: str | None = None
    ) -> list[WorkflowSummary]:
        found = await self.call("GET", "/v1/workflows", limit=limit, after=after, name=name)
        return read_answer("/v1/workflows", lambda: [from_json(WorkflowSummary, w) for w in found])

    async def history(self, task_id: UUID | str) -> list[Event]:
        events = await self.call("GET", f"/v1/tasks/{ident_of(task_id)}/events")
        return read_answer("events", lambda: [Event.model_validate(e) for e in events])

    async def log(self, task_id: UUID | str, timeout: float = 5.0) -> str | None:
        answer = await self.call("GET", f"/v1/tasks/{ident_of(task_id)}/logs", timeout=timeout + 30)
        text = read_answer("logs", lambda: answer["log"])
        if text is not None and not isinstance(text, str):
            raise SkedError("the API answered a log that is not text")
        return text

    async def workflow(self, workflow_id: UUID | str) -> WorkflowView:
        data = await self.call("GET", f"/v1/workflows/{ident_of(workflow_id, 'workflow')}")

        def view() -> WorkflowView:
            edges = [(UUID(e["upstream"]), UUID(e["task"]), e["condition"]) for e in data["edges"]]
            tasks = [task_of(t) for t in data["tasks"]]
            return WorkflowView(UUID(data["id"]), data["name"], tasks, edges)

        return read_answer("workflow", view)

    async def nodes(self) -> list[NodeRow]:
        found = await self.call("GET", "/v1/nodes")
        return read_answer("/v1/nodes", lambda: [node_of(n) for n in found])

    # -- control ------------------------------------------------------------------------------

    async def pause(self, task_id: UUID | str, reason: str, by: str | None = None) -> Task:
        body = {"reason": reason, "by": by}
        answer = await self.call("POST", f"/v1/tasks/{ident_of(task_id)}/pause", body)
        return read_answer("control", lambda: task_of(answer))

    async def resume(self, task_id: UUID | str, by: str | None = None) -> Task:
        answer = await self.call("POST", f"/v1/tasks/{ident_of(task_id)}/resume", {"by": by})
        return read_answer("control", lambda: task_of(answer))

    async def cancel(self, task_id: UUID | str, reason: str = "", by: str | None = None) -> Task:
        body = {"reason": reason, "by": by}
        answer = await self.call("POST", f"/v1/tasks/{ident_of(task_id)}/cancel", body)
        return read_answer("control", lambda: task_of(answer))

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
        path = f"/v1/workflows/{ident_of(workflow_id, 'workflow')}/{action}"
        moved = await self.call("POST", path, body)
        return read_answer(path, lambda: [task_of(t) for t in moved])

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        from shared.dead_letters import DeadLetter

        found = await self.call("GET", "/v1/dead", limit=limit)
        return read_answer("/v1/dead", lambda: [from_json(DeadLetter, d) for d in found])

    async def set_priority(self, task_id: UUID | str, priority: int) -> list[Task]:
        body = {"priority": priority}
        path = f"/v1/tasks/{ident_of(task_id)}/priority"
        changed = await self.call("POST", path, body)
        return read_answer(path, lambda: [task_of(t) for t in changed])

    async def cordon(self, node_id: str, reason: str = "") -> NodeRow:
        answer = await self.call(
            "POST", f"/v1/nodes/{quote(node_id, safe='')}/cordon", {"reason": reason}
        )
        return read_answer("nodes", lambda: node_of(answer))

    async def uncordon(self, node_id: str) -> NodeRow:
        answer = await self.call("POST", f"/v1/nodes/{quote(node_id, safe='')}/uncordon")
        return read_answer("nodes", lambda: node_of(answer))

    async def drain(self, node_id: str, timeout: float | None = None, reason: str = "") -> Drain:
        """Cordon, then wait up to `timeout` s (None: until drained), asking the API to wait
        up to 10 minutes at a time."""

        deadline = deadline_of(timeout)
        pause = POLL_S[0]
        while True:
            left = 600.0 if deadline is None else max(0.0, min(600.0, deadline - time.monotonic()))
            path, body = f"/v1/nodes/{quote(node_id, safe='')}/drain", {"reason": reason}
            asked = time.monotonic()
            data = await self.call("POST", path, body, timeout=left + 30, wait=round(left, 3))
            done = read_answer(path, functools.partial(drain_of, data))
            if done.done or (deadline is not None and time.monotonic() >= deadline):
                return done
            if time.monotonic() - asked < left / 2:  # answered early: never a busy loop
                await asyncio.sleep(pause)
                pause = min(pause * 1.5, POLL_S[1])

    # -- wait ---------------------------------------------------------------------------------

    async def wait(self, task_id: UUID | str, timeout: float | None = None) -> Task:
        return (await self.wait_all([task_id], timeout))[UUID(str(task_id))]

    async def wait_all(
        self, task_ids: Iterable[UUID | str], timeout: float | None = None
    ) -> dict[UUID, Task]:
        """Poll until every task is terminal. A task not yet admitted counts as pending, and an
        API that cannot answer now (ApiUnavailable) is asked again. Each request is bounded
        by what is left of the timeout: a slow server ends the wait on time, as WaitTimeout;
        but with a timeout of 0 or less the first round of asking has FIRST_LOOK_S, so that
        it still reads a finished task, as SkedClient's does."""
        if isinstance(task_ids, str | bytes | UUID):
            raise InvalidSpec("wait_all takes a collection of task ids, not one id")
        pending = {ident_of(i) for i in task_ids}
        done: dict[UUID, Task] = {}
        deadline = deadline_of(timeout)
        pause = POLL_S[0]
        first = True
        # a timeout of 0 (or less) still reads each task once, as SkedClient's wait does
        look = FIRST_LOOK_S if timeout is not None and timeout <= 0 else 0.0
        first_until = None if deadline is None else max(deadline, time.monotonic()) + look
        while True:
            for task_id in sorted(pending):
                until = first_until if first else deadline
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    break
                try:
                    task = await self._get(
                        task_id, None if left is None else min(self.timeout, left)
                    )
                except Purged:
                    raise
                except (NotFound, ApiUnavailable):
                    continue  # its submission is still on its way; the API is back soon
                except SkedError:
                    if deadline is not None and time.monotonic() >= deadline:
                        break  # the request ran into the deadline: the wait is over
                    raise
                if fsm.is_terminal(task.status, fsm.has_retry_left(task)):
                    done[task_id] = task
                    pending.discard(task_id)
            first = False
            if not pending:
                return done
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(pending, timeout or 0)
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, POLL_S[1])

    async def wait_workflow(
        self, workflow_id: UUID | str, timeout: float | None = None
    ) -> WorkflowView:
        deadline = deadline_of(timeout)
        while True:
            try:
                view = await self.workflow(workflow_id)
                break
            except Purged:
                raise
            except NotFound:
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeout([ident_of(workflow_id, "workflow")], timeout or 0) from None
                await asyncio.sleep(POLL_S[0])
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        await self.wait_all([t.id for t in view.tasks], left)
        return await self.workflow(workflow_id)
