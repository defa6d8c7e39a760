"""The API's operations as data, and what every one of them shares: bearer-token auth by role,
errors as JSON, bodies validated by pydantic, the audit of every change.

Each handler is registered with `@op(...)`: its method, path, the role it needs, what it takes
and returns. The routes (app.py) and the OpenAPI document (openapi.py) are both made from that
one table, so the two cannot disagree.

Errors are `{"error": "..."}` with a status that says which: 400 a bad request (an invalid spec,
a bad parameter), 401 no token or an unknown or revoked one (with `WWW-Authenticate: Bearer`),
403 a token whose role is too low, 404 an unknown task, workflow, node or token, 410 a task or
workflow retention deleted, 409 a state that does not allow the action (a terminal task, say),
503 Postgres or RabbitMQ away.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar
from uuid import UUID

from aiohttp import web
from pydantic import BaseModel, ValidationError

from shared import jsonvalue
from shared.auth import Role, bearer, digest
from shared.client import SkedClient
from shared.errors import (
    IllegalTransition,
    InvalidSpec,
    NotAllowed,
    NotFound,
    Purged,
    SkedError,
    StaleWrite,
)
from shared.policy import JobPolicy
from shared.resilience import TRANSIENT
from shared.settings import Settings
from shared.store import Store
from shared.store.tokens import NameTaken, TokenRow
from shared.throttle import Throttled

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=BaseModel)

CLIENT = web.AppKey("client", SkedClient)
STORE = web.AppKey("store", Store)
SETTINGS = web.AppKey("settings", Settings)
POLICY = web.AppKey("policy", JobPolicy)
# anyone who reaches the API can be refused at will: a warning line per kind every few seconds
REFUSALS = web.AppKey("refusals", dict[str, Throttled])


def refusals() -> dict[str, Throttled]:
    return {"unknown": Throttled(log), "role": Throttled(log)}


# the token the request in hand was authenticated with (each request is a task of its own)
TOKEN: ContextVar[TokenRow] = ContextVar("sked_api_token")


@dataclass(frozen=True)
class Param:
    """A query parameter, as the OpenAPI document shows it."""

    name: str
    schema: dict[str, Any]
    description: str
    many: bool = False


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    role: Role | None  # None: no token needed (health, the document itself)
    summary: str
    tag: str
    handler: Handler
    ok: int = 200
    response: type[BaseModel] | None = None
    many: bool = False  # the response is a list of `response`
    body: type[BaseModel] | None = None
    body_required: bool = True
    query: tuple[Param, ...] = ()
    conflict: bool = False  # may answer 409

    @property
    def errors(self) -> list[int]:
        codes = set()
        if self.body is not None or self.query or "{" in self.path:
            codes.add(400)
        if self.role is not None:
            codes.add(401)
            if self.role is not Role.READ:
                codes.add(403)
        if "{" in self.path:
            codes.add(404)
        if self.path.startswith(("/v1/tasks/{", "/v1/workflows/{")):
            codes.add(410)  # shared.errors.Purged
        if self.conflict:
            codes.add(409)
        if self.role is not None:
            codes.add(503)
        return sorted(codes)


OPS: list[Op] = []


def op(
    method: str, path: str, role: Role | None, summary: str, tag: str, **kw: Any
) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        OPS.append(Op(method, path, role, summary, tag, handler, **kw))
        return handler

    return register


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


CHALLENGE = {"WWW-Authenticate": 'Bearer realm="sked"'}

# a SkedError raised on purpose -> its status; the first match wins (subclasses first)
STATUS: tuple[tuple[type[SkedError], int], ...] = (
    (Purged, 410),
    (NotFound, 404),
    (NotAllowed, 409),
    (StaleWrite, 409),
    (IllegalTransition, 409),
    (NameTaken, 409),
    (InvalidSpec, 400),
    (SkedError, 400),
)


def problem(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as JSON with its status."""
    try:
        return await handler(request)
    except ApiError as exc:
        return problem(exc.status, exc.message, exc.headers)
    except web.HTTPException as exc:  # aiohttp's own: no such route, method, body too big
        if exc.status < 400:
            raise
        keep = {k: v for k, v in exc.headers.items() if k in ("Allow", "WWW-Authenticate")}
        return problem(exc.status, exc.reason, keep)
    except SkedError as exc:
        status = next(code for kind, code in STATUS if isinstance(exc, kind))
        return problem(status, str(exc))
    except TRANSIENT as exc:
        log.warning("%s %s: a backend is away: %s", request.method, request.path, exc)
        return problem(503, "a backend (Postgres, Redis or RabbitMQ) is unavailable; retry")
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return problem(500, "internal error (logged by the API)")


def guarded(o: Op) -> Handler:
    """The handler behind its role check: 401 without a live token, 403 below the role."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if o.role is not None:
            TOKEN.set(await authenticate(request, o.role))
        for name, value in request.query.items():  # what no query parameter may hold
            bad = jsonvalue.bad_text(name) or jsonvalue.bad_text(value)
            if bad:
                raise ApiError(400, f"query parameter {name!r} holds {bad}")
        for name, value in request.match_info.items():  # nor a path's part (a node's id)
            if bad := jsonvalue.bad_text(value):
                raise ApiError(400, f"{name} holds {bad}")
        return await o.handler(request)

    return handle


async def authenticate(request: web.Request, needed: Role) -> TokenRow:
    secret = bearer(request.headers.get("Authorization"))
    if secret is None:
        raise ApiError(401, "a bearer token is required (Authorization: Bearer ...)", CHALLENGE)
    token = await request.app[STORE].tokens.authenticate(digest(secret))
    if token is None:
        unknown = request.app[REFUSALS]["unknown"]
        unknown.warning("%s %s: unknown or revoked token", request.method, request.path)
        raise ApiError(401, "unknown or revoked token", CHALLENGE)
    if not token.role.allows(needed):
        below = request.app[REFUSALS]["role"]
        below.warning("%s %s: token %s refused", request.method, request.path, token.name)
        raise ApiError(
            403,
            f"token {token.name} has role {token.role.value}; this needs {needed.value}",
            {"WWW-Authenticate": 'Bearer realm="sked", error="insufficient_scope"'},
        )
    return token


# -- what handlers use ------------------------------------------------------------------------


def client(request: web.Request) -> SkedClient:
    return request.app[CLIENT]


def store(request: web.Request) -> Store:
    return request.app[STORE]


def token(request: web.Request) -> TokenRow:
    return TOKEN.get()


DIGITS = re.compile(r"[0-9]{1,9}")  # ASCII: str.isdigit() takes "²", which int() refuses


def limit_param(request: web.Request, most: int) -> int:
    """A listing's `limit` (100 when not given): an integer from 1 to `most`, else 400."""
    text = request.query.get("limit", "100")
    if not DIGITS.fullmatch(text) or not 1 <= int(text) <= most:
        raise ApiError(400, f"limit must be an integer from 1 to {most}: {text!r}")
    return int(text)


def actor(request: web.Request, on_behalf: str | None = None) -> str:
    """Who acts, as recorded (`by`): the token, and whom the caller says it acts for."""
    who = f"token:{token(request).name}"
    return f"{who} for {on_behalf}" if on_behalf else who


async def audit(request: web.Request, action: str, target: object, detail: str = "") -> None:
    """Record a change made through the API (after it was made)."""
    name = token(request).name
    await store(request).tokens.audit(name, action, str(target), detail)
    log.info("%s %s by token %s%s", action, target, name, f": {detail}" if detail else "")


def reply(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


async def json_body(request: web.Request, required: bool = True) -> Any:
    raw = await request.read()
    if not raw.strip():
        if required:
            raise ApiError(400, "a JSON body is required")
        return {}
    try:  # strict: what Postgres could not store (a NUL, NaN, ...) is refused here, named
        return jsonvalue.parse(raw)
    except jsonvalue.Unsafe as exc:
        raise ApiError(400, f"the body is not JSON sked can take: {exc}") from None


async def body(request: web.Request, model: type[M], required: bool = True) -> M:
    data = await json_body(request, required)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        where = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(body)'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        raise ApiError(400, f"invalid body: {where}") from None


def parse_uuid(text: str, what: str | None = None) -> UUID:
    """`text` as an id, or 400 (naming `what`, a parameter, when given)."""
    try:
        return UUID(text)
    except ValueError:
        said = f"{what} must be a task id" if what else "not an id"
        raise ApiError(400, f"{said}: {text!r}") from None


def uuid_param(request: web.Request, name: str = "id") -> UUID:
    return parse_uuid(request.match_info[name])


NUMBER = re.compile(r"^\d+(\.\d+)?$")


def number_param(request: web.Request, name: str, default: float, high: float) -> float:
    text = request.query.get(name)
    if text is None:
        return default
    if not NUMBER.match(text) or float(text) > high:
        raise ApiError(400, f"{name} must be a number from 0 to {high:g}: {text!r}")
    return float(text)
