"""`/v1/nodes` (list, cordon, uncordon, drain), `/v1/tokens` and `/v1/audit` (admin), and
the unauthenticated `/healthz`.

Cordon and drain go through shared.cordon, the CLI's path: a cordoned node takes no new work and
what runs there runs on. A drain answers 200 once nothing holds the node, or 202 with what
still does when `wait` seconds (at most MAX_WAIT_S) ran out first: call it again to go on
waiting (a cordon is kept, so a second call only waits).
"""

from __future__ import annotations

from aiohttp import web

from services.api import schemas
from services.api.ops import (
    ApiError,
    Param,
    actor,
    audit,
    body,
    limit_param,
    number_param,
    op,
    reply,
    store,
)
from shared import cordon
from shared.auth import Role

MAX_WAIT_S = 600.0

WAIT = Param(
    "wait",
    {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S},
    "seconds to wait for the node to drain before answering (default 0: answer at once)",
)
AUDIT_LIMIT = Param("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "at most (100)")
AUDIT_TOKEN = Param("token", {"type": "string"}, "only this token's changes")


@op(
    "GET",
    "/healthz",
    None,
    "Liveness: the API is up and connected",
    "meta",
    response=schemas.Health,
)
async def healthz(_: web.Request) -> web.StreamResponse:
    return reply({"ok": True})


@op(
    "GET",
    "/v1/nodes",
    Role.READ,
    "Registered nodes: capacity, usage, liveness, cordon",
    "nodes",
    response=schemas.NodeView,
    many=True,
)
async def list_nodes(request: web.Request) -> web.StreamResponse:
    return reply([n.as_json() for n in await store(request).nodes.all()])


@op(
    "POST",
    "/v1/nodes/{node}/cordon",
    Role.OPERATE,
    "Cordon a node: no new work there; what runs there runs on",
    "nodes",
    response=schemas.NodeView,
    body=schemas.CordonBody,
    body_required=False,
)
async def cordon_node(request: web.Request) -> web.StreamResponse:
    node_id = request.match_info["node"]
    b = await body(request, schemas.CordonBody, required=False)
    row = await cordon.cordon(store(request), node_id, actor(request), b.reason)
    await audit(request, "cordon", node_id, b.reason)
    return reply(row.as_json())


@op(
    "POST",
    "/v1/nodes/{node}/uncordon",
    Role.OPERATE,
    "Lift a node's cordon",
    "nodes",
    response=schemas.NodeView,
)
async def uncordon_node(request: web.Request) -> web.StreamResponse:
    node_id = request.match_info["node"]
    row = await cordon.uncordon(store(request), node_id)
    await audit(request, "uncordon", node_id)
    return reply(row.as_json())


@op(
    "POST",
    "/v1/nodes/{node}/drain",
    Role.OPERATE,
    "Drain a node: cordon it, then wait until no attempt holds it (200; 202: not yet; "
    "409: uncordoned meanwhile)",
    "nodes",
    ok=200,
    response=schemas.Drain,
    body=schemas.CordonBody,
    body_required=False,
    query=(WAIT,),
    conflict=True,
)
async def drain_node(request: web.Request) -> web.StreamResponse:
    node_id = request.match_info["node"]
    wait = number_param(request, "wait", 0.0, MAX_WAIT_S)
    b = await body(request, schemas.CordonBody, required=False)
    await cordon.node(store(request), node_id)  # 404 before anything is written or audited
    await audit(request, "drain", node_id, b.reason)
    done = await cordon.drain(store(request), node_id, actor(request), wait, b.reason)
    return reply(done.as_json(), 200 if done.done else 202)


@op(
    "GET",
    "/v1/tokens",
    Role.ADMIN,
    "API tokens (never their secrets)",
    "tokens",
    response=schemas.TokenView,
    many=True,
)
async def list_tokens(request: web.Request) -> web.StreamResponse:
    return reply([t.as_json() for t in await store(request).tokens.all()])


@op(
    "POST",
    "/v1/tokens",
    Role.ADMIN,
    "Create a token: its secret is in this answer only",
    "tokens",
    ok=201,
    response=schemas.TokenCreated,
    body=schemas.TokenBody,
    conflict=True,
)
async def create_token(request: web.Request) -> web.StreamResponse:
    b = await body(request, schemas.TokenBody)
    row, secret = await store(request).tokens.issue(b.role, b.name)
    await audit(request, "token-create", row.name, row.role.value)
    return reply({"token": row.as_json(), "secret": secret}, 201)


@op(
    "POST",
    "/v1/tokens/{name}/revoke",
    Role.ADMIN,
    "Revoke a token: it authenticates nothing from now on",
    "tokens",
    response=schemas.TokenView,
)
async def revoke_token(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    row = await store(request).tokens.revoke(name)
    if row is None:
        raise ApiError(404, f"no token {name!r}")
    await audit(request, "token-revoke", name)
    return reply(row.as_json())


@op(
    "GET",
    "/v1/audit",
    Role.ADMIN,
    "The latest changes made through the API, newest first",
    "tokens",
    response=schemas.AuditView,
    many=True,
    query=(AUDIT_LIMIT, AUDIT_TOKEN),
)
async def read_audit(request: web.Request) -> web.StreamResponse:
    limit = limit_param(request, 1000)
    rows = await store(request).tokens.audit_log(limit, request.query.get("token"))
    return reply([r.as_json() for r in rows])
