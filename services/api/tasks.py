"""`/v1/tasks` and `/v1/workflows`: read, submit and control tasks; `/v1/dead`: the submissions
intake refused.

Submissions go out through the SDK's own path (`SkedClient.submit`: RabbitMQ, confirmed), so
intake stays the only writer of new tasks; the answer is 202 with the id, and admission follows.
Control goes through shared.control like the CLI's, with the token named as `by`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.api import schemas
from services.api.ops import (
    POLICY,
    ApiError,
    Param,
    actor,
    audit,
    body,
    client,
    json_body,
    limit_param,
    op,
    parse_uuid,
    reply,
    uuid_param,
)
from shared.auth import Role
from shared.dag import WorkflowSpec
from shared.errors import NotFound
from shared.fsm import State
from shared.models import Event, Task, TaskSpec
from shared.views import WorkflowView

MAX_LIST = 1000

STATUS = Param(
    "status",
    {"type": "string", "enum": [s.value for s in State]},
    "only tasks in these states (repeat it, or separate with commas)",
    many=True,
)
LIMIT = Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIST}, "at most (100)")
WORKFLOW = Param("workflow", {"type": "string", "format": "uuid"}, "only this workflow's tasks")
NAME = Param("name", {"type": "string"}, "only tasks of this name")
AFTER = Param(
    "after",
    {"type": "string", "format": "uuid"},
    "the next page: the tasks after this one, the last of the page before (a full page's "
    'Link header, rel="next", names it)',
)


def _limit(request: web.Request) -> int:
    return limit_param(request, MAX_LIST)


def workflow_json(view: WorkflowView) -> dict[str, Any]:
    return {
        "id": str(view.id),
        "name": view.name,
        "status": view.status(),
        "counts": view.counts(),
        "tasks": [t.as_json() for t in view.tasks],
        "edges": [
            {"upstream": str(up), "task": str(down), "condition": cond}
            for up, down, cond in view.edges
        ],
    }


def _tasks(tasks: list[Task]) -> web.Response:
    return reply([t.as_json() for t in tasks])


def _page(request: web.Request, rows: list[dict[str, Any]], limit: int) -> web.Response:
    """A page of a listing (each row with its "id"); a full one links to the next (RFC 8288),
    which may be empty."""
    response = reply(rows)
    if rows and len(rows) == limit:
        following = request.rel_url.update_query(after=str(rows[-1]["id"]))
        response.headers["Link"] = f'<{following}>; rel="next"'
    return response


@op(
    "GET",
    "/v1/tasks",
    Role.READ,
    "List tasks, newest first",
    "tasks",
    response=schemas.TaskView,
    many=True,
    query=(STATUS, NAME, LIMIT, WORKFLOW, AFTER),
)
async def list_tasks(request: web.Request) -> web.StreamResponse:
    wanted = [State.parse(s) for v in request.query.getall("status", []) for s in v.split(",") if s]
    limit = _limit(request)
    after = parse_uuid(request.query["after"], "after") if "after" in request.query else None
    name = request.query.get("name")
    if "workflow" in request.query:
        view = await client(request).workflow(parse_uuid(request.query["workflow"]))
        listed = [
            t
            for t in view.tasks
            if (not wanted or t.status in wanted) and (name is None or t.name == name)
        ]
        if after is not None:
            ids = [t.id for t in listed]
            if after not in ids:
                raise NotFound(f"task {after} is not among the tasks listed (after)")
            listed = listed[ids.index(after) + 1 :]
        return _page(request, [t.as_json() for t in listed[:limit]], limit)
    found = await client(request).tasks(wanted or None, limit, after, name)
    return _page(request, [t.as_json() for t in found], limit)


@op(
    "POST",
    "/v1/tasks",
    Role.OPERATE,
    "Submit a task (TaskSpec); admission follows",
    "tasks",
    ok=202,
    response=schemas.Accepted,
    body=TaskSpec,
)
async def submit_task(request: web.Request) -> web.StreamResponse:
    spec = TaskSpec.parse(await json_body(request))
    refused = request.app[POLICY].refuses(spec.job)  # refused now, not dead-lettered later
    if refused:
        raise ApiError(400, refused)
    task_id = await client(request).submit(spec)
    await audit(request, "submit", task_id, spec.name)
    return reply({"id": str(task_id)}, 202)


@op("GET", "/v1/tasks/{id}", Role.READ, "One task", "tasks", response=schemas.TaskView)
async def get_task(request: web.Request) -> web.StreamResponse:
    return reply((await client(request).get(uuid_param(request))).as_json())


@op(
    "GET",
    "/v1/tasks/{id}/events",
    Role.READ,
    "A task's transitions, in order",
    "tasks",
    response=Event,
    many=True,
)
async def task_events(request: web.Request) -> web.StreamResponse:
    events = await client(request).history(uuid_param(request))
    return reply([e.model_dump(mode="json") for e in events])


@op(
    "GET",
    "/v1/tasks/{id}/logs",
    Role.READ,
    "A task's log: live while it runs, else the tail",
    "tasks",
    response=schemas.Log,
)
async def task_logs(request: web.Request) -> web.StreamResponse:
    task_id = uuid_param(request)
    sked = client(request)
    text = await sked.log(task_id, sked.settings.probe_timeout_s)
    task = await sked.get(task_id)
    return reply({"id": str(task_id), "status": task.status.value, "log": text})


@op(
    "POST",
    "/v1/tasks/{id}/pause",
    Role.OPERATE,
    "Pause a task (a running attempt stops)",
    "tasks",
    response=schemas.TaskView,
    body=schemas.PauseBody,
    conflict=True,
)
async def pause_task(request: web.Request) -> web.StreamResponse:
    task_id, b = uuid_param(request), await body(request, schemas.PauseBody)
    task = await client(request).pause(task_id, b.reason, actor(request, b.by))
    await audit(request, "pause", task_id, b.reason)
    return reply(task.as_json())


@op(
    "POST",
    "/v1/tasks/{id}/resume",
    Role.OPERATE,
    "Resume a paused task",
    "tasks",
    response=schemas.TaskView,
    body=schemas.ResumeBody,
    body_required=False,
    conflict=True,
)
async def resume_task(request: web.Request) -> web.StreamResponse:
    task_id, b = uuid_param(request), await body(request, schemas.ResumeBody, required=False)
    task = await client(request).resume(task_id, actor(request, b.by))
    await audit(request, "resume", task_id)
    return reply(task.as_json())


@op(
    "POST",
    "/v1/tasks/{id}/cancel",
    Role.OPERATE,
    "Cancel a task (a running attempt stops)",
    "tasks",
    response=schemas.TaskView,
    body=schemas.CancelBody,
    body_required=False,
    conflict=True,
)
async def cancel_task(request: web.Request) -> web.StreamResponse:
    task_id, b = uuid_param(request), await body(request, schemas.CancelBody, required=False)
    task = await client(request).cancel(task_id, b.reason, actor(request, b.by))
    await audit(request, "cancel", task_id, b.reason)
    return reply(task.as_json())


@op(
    "POST",
    "/v1/tasks/{id}/priority",
    Role.OPERATE,
    "Set a task's priority; returns the tasks whose priority changed, this one first",
    "tasks",
    response=schemas.TaskView,
    many=True,
    body=schemas.PriorityBody,
    conflict=True,
)
async def set_priority(request: web.Request) -> web.StreamResponse:
    task_id, b = uuid_param(request), await body(request, schemas.PriorityBody)
    changed = await client(request).set_priority(task_id, b.priority)
    await audit(request, "priority", task_id, str(b.priority))
    return _tasks(changed)


@op(
    "POST",
    "/v1/workflows",
    Role.OPERATE,
    "Submit a workflow (accepted or rejected whole)",
    "workflows",
    ok=202,
    response=schemas.Accepted,
    body=WorkflowSpec,
)
async def submit_workflow(request: web.Request) -> web.StreamResponse:
    spec = WorkflowSpec.parse(await json_body(request))
    for task in spec.tasks:
        refused = request.app[POLICY].refuses(task.spec().job)
        if refused:
            raise ApiError(400, f"task {task.name!r}: {refused}")
    workflow_id = await client(request).submit_workflow(spec)
    await audit(request, "submit-workflow", workflow_id, spec.name)
    return reply({"id": str(workflow_id)}, 202)


@op(
    "GET",
    "/v1/workflows",
    Role.READ,
    "List workflows, newest first, each with its status and its tasks counted by state",
    "workflows",
    response=schemas.WorkflowSummaryView,
    many=True,
    query=(NAME, LIMIT, AFTER),
)
async def list_workflows(request: web.Request) -> web.StreamResponse:
    limit = _limit(request)
    after = parse_uuid(request.query["after"], "after") if "after" in request.query else None
    found = await client(request).workflows(limit, after, request.query.get("name"))
    return _page(request, [w.as_json() for w in found], limit)


@op(
    "GET",
    "/v1/workflows/{id}",
    Role.READ,
    "A workflow: status, counts, tasks and edges",
    "workflows",
    response=schemas.Workflow,
)
async def get_workflow(request: web.Request) -> web.StreamResponse:
    return reply(workflow_json(await client(request).workflow(uuid_param(request))))


@op(
    "POST",
    "/v1/workflows/{id}/pause",
    Role.OPERATE,
    "Pause every task of a workflow that has not ended (running attempts stop); returns them",
    "workflows",
    response=schemas.TaskView,
    many=True,
    body=schemas.PauseBody,
    conflict=True,
)
async def pause_workflow(request: web.Request) -> web.StreamResponse:
    workflow_id, b = uuid_param(request), await body(request, schemas.PauseBody)
    paused = await client(request).pause_workflow(workflow_id, b.reason, actor(request, b.by))
    await audit(request, "pause-workflow", workflow_id, b.reason)
    return _tasks(paused)


@op(
    "POST",
    "/v1/workflows/{id}/resume",
    Role.OPERATE,
    "Resume every paused task of a workflow; returns them",
    "workflows",
    response=schemas.TaskView,
    many=True,
    body=schemas.ResumeBody,
    body_required=False,
    conflict=True,
)
async def resume_workflow(request: web.Request) -> web.StreamResponse:
    workflow_id = uuid_param(request)
    b = await body(request, schemas.ResumeBody, required=False)
    resumed = await client(request).resume_workflow(workflow_id, actor(request, b.by))
    await audit(request, "resume-workflow", workflow_id)
    return _tasks(resumed)


@op(
    "POST",
    "/v1/workflows/{id}/cancel",
    Role.OPERATE,
    "Cancel every task of a workflow that has not ended (running attempts stop); returns them",
    "workflows",
    response=schemas.TaskView,
    many=True,
    body=schemas.CancelBody,
    body_required=False,
    conflict=True,
)
async def cancel_workflow(request: web.Request) -> web.StreamResponse:
    workflow_id = uuid_param(request)
    b = await body(request, schemas.CancelBody, required=False)
    canceled = await client(request).cancel_workflow(workflow_id, b.reason, actor(request, b.by))
    await audit(request, "cancel-workflow", workflow_id, b.reason)
    return _tasks(canceled)


@op(
    "GET",
    "/v1/dead",
    Role.OPERATE,  # a refused message may hold what its producer meant to keep to the workers
    "Refused submissions in sked.dead, oldest first, each with its reason (left in place)",
    "tasks",
    response=schemas.DeadLetterView,
    many=True,
    query=(LIMIT,),
)
async def dead_letters(request: web.Request) -> web.StreamResponse:
    letters = await client(request).dead_letters(_limit(request))
    return reply([d.as_json() for d in letters])
