"""The operator API without servers: its OpenAPI document is valid OpenAPI 3.1 and covers every
route; the views it documents are what rows really give; auth answers 401 / 403 as promised,
and errors are JSON with their status (tokens and tasks from in-memory fakes). The HTTP client
rebuilds rows from their JSON exactly. The real thing runs in tests/e2e/test_api.py."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any
from uuid import UUID, uuid4

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import validate

from services.api import schemas
from services.api.app import make_app
from services.api.openapi import document
from shared.api_client import ApiClient, node_of, task_of
from shared.auth import Role, bearer, digest, new_secret
from shared.client import WaitTimeout
from shared.control import NotAllowed
from shared.dead_letters import DeadLetter
from shared.errors import NotFound, Purged, missing
from shared.fsm import State
from shared.placement import Need, NodeState, choose
from shared.settings import Settings
from shared.store import NodeRow
from shared.store.tokens import TokenRow
from shared.views import WorkflowSummary, WorkflowView
from tests.fakes.store import new_task
from tests.helpers import spec

# -- the document ---------------------------------------------------------------------------


def test_the_openapi_document_is_valid_openapi_3_1() -> None:
    doc = document()
    assert doc["openapi"].startswith("3.1")
    validate(doc)  # openapi-spec-validator: the structure, and every $ref resolves


def test_every_route_is_in_the_document_with_its_role() -> None:
    app = make_app(Settings(), None, None)  # type: ignore[arg-type]  # routes only
    doc = document()
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.resource}
    documented = {(m, p) for p, item in doc["paths"].items() for m in item}
    assert routes == documented
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            public = path in ("/healthz", "/v1/openapi.json")
            assert (operation["security"] == []) == public, (method, path)
            if method != "get" and not public:  # every change needs at least operate
                assert operation["x-sked-role"] in ("operate", "admin"), (method, path)
                assert "403" in operation["responses"]
    schemas_ = doc["components"]["schemas"]
    assert {"TaskSpec", "Task", "Event", "Node", "WorkflowSpec", "Error"} <= schemas_.keys()


def test_the_views_are_what_rows_give() -> None:
    task = new_task(spec("v"), status=State.RUNNING, node="n1", paused_at=datetime.now(UTC))
    assert schemas.TaskView.model_validate(task.as_json()).model_dump(mode="json").keys() == (
        task.as_json().keys()
    )
    node = _node("n1", cordoned_at=datetime.now(UTC), cordoned_by="token:ops")
    assert set(schemas.NodeView.model_fields) == set(node.as_json())
    schemas.NodeView.model_validate(node.as_json())
    schemas.TokenView.model_validate(_token("ops", Role.OPERATE).as_json())


def test_the_client_rebuilds_rows_from_their_json() -> None:
    task = new_task(spec("r"), status=State.PAUSED, paused_at=datetime.now(UTC), node="n1")
    rebuilt = task_of(task.as_json())
    assert rebuilt.spec == task.spec  # the spec's JSON text is laid out anew: same content
    assert dataclasses.replace(rebuilt, spec_json=task.spec_json) == task
    node = _node("n2", cordoned_at=datetime.now(UTC), cordoned_by="alice", cordon_reason="disk")
    assert node_of(node.as_json()) == node


# -- auth and errors ------------------------------------------------------------------------


def test_roles_are_ordered_and_secrets_hashed() -> None:
    assert Role.ADMIN.allows(Role.OPERATE)
    assert Role.OPERATE.allows(Role.READ)
    assert not Role.READ.allows(Role.OPERATE)
    assert not Role.OPERATE.allows(Role.ADMIN)
    a, b = new_secret(), new_secret()
    assert a != b
    assert a.startswith("sked_")
    assert len(a) > 40
    assert digest(a) != digest(b)
    assert len(digest(a)) == 64
    assert bearer("Bearer  xyz ") == "xyz"
    assert bearer("bearer xyz") == "xyz"
    assert bearer("Basic xyz") is None
    assert bearer("Bearer ") is None
    assert bearer(None) is None


def _token(name: str, role: Role) -> TokenRow:
    return TokenRow(name, role, datetime.now(UTC), None, None)


def _node(node_id: str, **kw: Any) -> NodeRow:
    now = datetime.now(UTC)
    values: dict[str, Any] = {
        "id": node_id,
        "slots": 2,
        "cpu": 2.0,
        "memory_mb": 512,
        "gpu": 0,
        "labels": {"zone": "a"},
        "ready": True,
        "live": True,
        "load": 0.1,
        "boot_id": uuid4(),
        "registered_at": now,
        "heartbeat_at": now,
        "used_slots": 0,
        "used_cpu": 0.0,
        "used_memory_mb": 0,
        "used_gpu": 0,
    }
    values.update(kw)
    return NodeRow(**values)


NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


class FakeTokens:
    def __init__(self, **secrets: Role) -> None:
        self.by_hash = {digest(s): _token(f"t-{r.value}", r) for s, r in secrets.items()}
        self.audited: list[tuple[str, str, str]] = []

    async def authenticate(self, secret_sha256: str) -> TokenRow | None:
        return self.by_hash.get(secret_sha256)

    async def audit(self, token: str, action: str, target: str, detail: str = "") -> None:
        self.audited.append((token, action, target))


class FakeClient:
    """Task 0 is unknown; task 1 is terminal; LISTED are the tasks, newest first, and one
    workflow's (the store's paging is tests/integration/test_repo.py's)."""

    settings = Settings()
    WORKFLOW = uuid4()
    PURGED = uuid4()  # a task retention deleted
    LISTED = [new_task(spec(f"t{i}")) for i in range(5)]

    async def tasks(
        self, statuses: Any, limit: int, after: UUID | None, name: str | None
    ) -> list[Any]:
        named = [t for t in self.LISTED if name is None or t.name == name]
        ids = [t.id for t in named]
        if after is not None and after not in ids:
            raise NotFound(f"no task {after} to list after")
        return named[ids.index(after) + 1 if after else 0 :][:limit]

    async def workflow(self, workflow_id: UUID) -> WorkflowView:
        return WorkflowView(workflow_id, "w", self.LISTED, [])

    async def get(self, task_id: UUID) -> Any:
        if task_id == self.PURGED:
            raise missing("task", task_id, NOW)
        raise NotFound(f"no task {task_id}")

    async def cancel(self, task_id: UUID, reason: str = "", by: str | None = None) -> Any:
        raise NotAllowed(f"cannot cancel task {task_id}: it is Success, a terminal state")

    async def workflows(
        self, limit: int, after: UUID | None, name: str | None
    ) -> list[WorkflowSummary]:
        return [WorkflowSummary(self.WORKFLOW, "w", NOW, {"success": 1, "running": 1}, 1)][:limit]

    async def dead_letters(self, limit: int) -> list[DeadLetter]:
        letter = DeadLetter("not JSON", "submit", None, 3, "\x1b[2J")
        return [letter] * min(limit, 2)

    async def cancel_workflow(self, wf: UUID, reason: str = "", by: str | None = None) -> Any:
        raise NotAllowed(f"workflow {wf} has ended: every task of it is terminal")


@pytest.fixture
async def api() -> AsyncIterator[tuple[TestClient[Any, Any], FakeTokens]]:
    tokens = FakeTokens(reader=Role.READ, operator=Role.OPERATE)
    app = make_app(Settings(), SimpleNamespace(tokens=tokens), FakeClient())  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        yield client, tokens


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_no_token_or_an_unknown_one_is_401_with_a_challenge(
    api: tuple[TestClient[Any, Any], FakeTokens],
) -> None:
    client, _ = api
    for headers in ({}, auth("sked_nope"), {"Authorization": "Basic cmVhZGVy"}):
        async with client.get("/v1/tasks", headers=headers) as r:
            assert r.status == 401
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            assert "error" in await r.json()


async def test_a_read_token_may_not_change_anything(
    api: tuple[TestClient[Any, Any], FakeTokens],
) -> None:
    client, tokens = api
    task = uuid4()
    async with client.post(f"/v1/tasks/{task}/cancel", headers=auth("reader")) as r:
        assert r.status == 403
        assert "has role read; this needs operate" in (await r.json())["error"]
    async with client.get("/v1/tokens", headers=auth("operator")) as r:
        assert r.status == 403  # token management needs admin
    assert tokens.audited == []


async def test_errors_are_json_with_their_status(
    api: tuple[TestClient[Any, Any], FakeTokens],
) -> None:
    client, tokens = api
    read, operate = auth("reader"), auth("operator")
    cases = [
        ("GET", f"/v1/tasks/{uuid4()}", read, None, 404),  # NotFound
        ("GET", f"/v1/tasks/{FakeClient.PURGED}", read, None, 410),  # Purged
        ("GET", "/v1/tasks/not-a-uuid", read, None, 400),
        ("GET", "/v1/tasks?limit=0", read, None, 400),
        ("GET", "/v1/tasks?status=bogus", read, None, 400),
        ("GET", "/v1/tasks?name=a%00b", read, None, 400),  # Postgres could not compare it
        (
            "POST",
            "/v1/tasks",
            operate,
            {"name": "\x00", "job": {"kind": "command", "argv": ["x"]}},
            400,
        ),
        ("POST", f"/v1/nodes/{uuid4()}/cordon", operate, {"reason": "a\x00"}, 400),
        ("POST", f"/v1/tasks/{uuid4()}/cancel", operate, None, 409),  # NotAllowed
        ("POST", f"/v1/workflows/{uuid4()}/cancel", operate, None, 409),
        ("POST", f"/v1/workflows/{uuid4()}/pause", operate, None, 400),  # a reason is required
        ("POST", f"/v1/workflows/{uuid4()}/pause", read, {"reason": "x"}, 403),
        ("POST", f"/v1/workflows/{uuid4()}/resume", operate, {"by": 1}, 400),
        ("GET", "/v1/dead", read, None, 403),  # a refused message may hold a producer's secret
        ("GET", "/v1/dead?limit=1001", operate, None, 400),
        ("POST", f"/v1/workflows/{uuid4()}/cancel", read, None, 403),
        ("POST", "/v1/workflows/not-a-uuid/cancel", operate, None, 400),
        ("POST", f"/v1/workflows/{uuid4()}/cancel", operate, {"reason": "a\x00"}, 400),
        ("POST", f"/v1/tasks/{uuid4()}/pause", operate, {"reason": ""}, 400),
        ("POST", f"/v1/tasks/{uuid4()}/pause", operate, {"reason": "x", "who": 1}, 400),
        ("POST", "/v1/tasks", operate, {"name": "x", "job": {"kind": "command"}}, 400),
        ("POST", "/v1/tasks", operate, None, 400),
        ("GET", "/v1/nothing-here", read, None, 404),
        ("DELETE", "/v1/tasks", read, None, 405),
    ]
    for method, path, headers, body, status in cases:
        async with client.request(method, path, headers=headers, json=body) as r:
            assert r.status == status, (method, path, await r.text())
            assert isinstance((await r.json())["error"], str)
    async with client.post(
        "/v1/tasks", headers=operate, data=b"{not json", allow_redirects=False
    ) as r:
        assert r.status == 400
    assert tokens.audited == []  # nothing was changed, so nothing recorded


async def test_a_full_page_links_to_the_next(
    api: tuple[TestClient[Any, Any], FakeTokens],
) -> None:
    """Listing pages by the last task seen: a full page's Link header (rel="next") repeats the
    query with `after` its last task, a short one has none; a cursor is checked."""
    client, _ = api
    listed = [str(t.id) for t in FakeClient.LISTED]
    for base in ("/v1/tasks?status=created&status=ready", f"/v1/tasks?workflow={uuid4()}"):
        seen: list[str] = []
        path: str | None = f"{base}&limit=2"
        while path is not None:
            async with client.get(path, headers=auth("reader")) as r:
                assert r.status == 200, await r.text()
                page = [t["id"] for t in await r.json()]
                seen += page
                link = r.headers.get("Link")
            if len(page) < 2:
                assert link is None
                path = None
            else:
                assert link is not None
                path = link.removeprefix("<").removesuffix('>; rel="next"')
                assert path.startswith(base), path
                assert path.endswith(f"&after={page[-1]}"), path
        assert seen == listed, base
    for base in ("/v1/tasks?", f"/v1/tasks?workflow={uuid4()}&"):
        async with client.get(f"{base}name=t3", headers=auth("reader")) as r:
            assert [t["name"] for t in await r.json()] == ["t3"]
    for bad, status in ((f"after={uuid4()}", 404), ("after=3", 400)):
        for base in ("/v1/tasks?", f"/v1/tasks?workflow={uuid4()}&"):
            async with client.get(base + bad, headers=auth("reader")) as r:
                assert r.status == status, (base, bad)
                assert "after" in (await r.json())["error"]


async def test_health_and_the_document_need_no_token(
    api: tuple[TestClient[Any, Any], FakeTokens],
) -> None:
    client, _ = api
    async with client.get("/healthz") as r:
        assert r.status == 200
        assert (await r.json()) == {"ok": True}
    async with client.get("/v1/openapi.json") as r:
        assert r.status == 200
        assert (await r.json()) == document()


# -- placement ------------------------------------------------------------------------------


def test_a_cordoned_node_takes_nothing_and_the_reason_says_so() -> None:
    cordoned = NodeState("a", 4, 8.0, 1000, 0, {"zone": "a"}, ready=False, cordoned=True)
    other = NodeState("b", 4, 8.0, 1000, 0, {"zone": "b"})
    assert choose(Need(), [cordoned, other]).node == other
    only = choose(Need(selector={"zone": "a"}), [cordoned, other])
    assert only.node is None
    assert not only.fits_later
    assert only.reason == "no node matches selector zone=a (1 cordoned node(s) could take it)"
    assert choose(Need(), [cordoned]).reason == "no ready node (1 cordoned node(s) could take it)"
    row = _node("a", cordoned_at=datetime.now(UTC))
    assert not row.state().ready
    assert row.state().cordoned


async def test_the_http_client_ends_a_wait_for_a_task_retention_deleted(
    api: tuple[TestClient[Any, Any], FakeTokens],
) -> None:
    """410 reads back as Purged, which ends a wait at once; a 404 is a task not admitted yet,
    polled for until the wait's timeout."""
    client, _ = api
    async with ApiClient(str(client.make_url("")), "reader") as remote:
        with pytest.raises(Purged, match="deleted by retention"):
            await asyncio.wait_for(remote.wait(FakeClient.PURGED, timeout=30), 5)
        with pytest.raises(WaitTimeout):
            await remote.wait(uuid4(), timeout=0.3)


async def test_dead_letters_are_read_with_an_operate_token(
    api: tuple[TestClient[Any, Any], FakeTokens],
) -> None:
    client, _ = api
    async with client.get("/v1/dead?limit=1", headers=auth("operator")) as r:
        assert r.status == 200
        assert await r.json() == [
            {
                "reason": "not JSON",
                "routing_key": "submit",
                "message_id": None,
                "size": 3,
                "body": "\x1b[2J",
            }
        ]


async def test_workflows_are_listed_with_their_status_by_pages(
    api: tuple[TestClient[Any, Any], FakeTokens],
) -> None:
    client, _ = api
    async with client.get("/v1/workflows?limit=1", headers=auth("reader")) as r:
        assert r.status == 200
        assert await r.json() == [
            {
                "id": str(FakeClient.WORKFLOW),
                "name": "w",
                "created_at": NOW.isoformat(),
                "status": "running",
                "counts": {"success": 1, "running": 1},
                "open": 1,
            }
        ]
        assert (
            r.headers["Link"] == f'</v1/workflows?limit=1&after={FakeClient.WORKFLOW}>; rel="next"'
        )
    async with client.get("/v1/workflows?after=nope", headers=auth("reader")) as r:
        assert r.status == 400
