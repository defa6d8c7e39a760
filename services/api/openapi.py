"""The OpenAPI 3.1 document of the API, made from the operations table (ops.OPS) and the
pydantic models (schemas.COMPONENTS, through `model_json_schema`): served at
`/v1/openapi.json` and checked by tests/unit/test_api_openapi.py with openapi-spec-validator."""

from __future__ import annotations

import functools
import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.api import nodes, tasks
from services.api.ops import OPS, Op
from services.api.schemas import COMPONENTS

HANDLERS = (tasks, nodes)  # the modules whose @op handlers make up the API (and OPS)
REF = "#/components/schemas/{model}"
PATH_PARAM = re.compile(r"\{(\w+)\}")
WHY = {
    400: "bad request: an invalid body, spec or parameter",
    401: "no bearer token, or an unknown or revoked one",
    403: "the token's role does not allow this",
    404: "no such task, workflow, node or token",
    409: "the current state does not allow this",
    410: "the task or workflow was deleted by retention (SKED_RETENTION_DAYS)",
    503: "Postgres, Redis or RabbitMQ is unavailable: retry",
}


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def operation(o: Op) -> dict[str, Any]:
    params: list[dict[str, Any]] = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": {"type": "string", "format": "uuid"} if name == "id" else {"type": "string"},
        }
        for name in PATH_PARAM.findall(o.path)
    ]
    for p in o.query:
        schema = {"type": "array", "items": p.schema} if p.many else p.schema
        params.append(
            {"name": p.name, "in": "query", "schema": schema, "description": p.description}
        )
    ok: dict[str, Any] = {"description": "OK" if o.ok == 200 else "Accepted"}
    if o.response is not None:
        shown = {"type": "array", "items": ref(o.response)} if o.many else ref(o.response)
        ok["content"] = _json(shown)
    responses: dict[str, Any] = {str(o.ok): ok}
    if o.path.endswith("/drain"):
        responses["202"] = {"description": "not drained yet", "content": ok["content"]}
    for code in o.errors:
        responses[str(code)] = {
            "description": WHY[code],
            "content": _json({"$ref": REF.format(model="Error")}),
        }
    out: dict[str, Any] = {
        "operationId": o.handler.__name__,
        "summary": o.summary,
        "tags": [o.tag],
        "parameters": params,
        "responses": responses,
        "security": [] if o.role is None else [{"bearer": []}],
    }
    if o.role is not None:
        out["x-sked-role"] = o.role.value
    if o.body is not None:
        out["requestBody"] = {"required": o.body_required, "content": _json(ref(o.body))}
    return out


@functools.cache
def document() -> dict[str, Any]:
    _, top = models_json_schema([(m, "validation") for m in COMPONENTS], ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for o in OPS:
        paths.setdefault(o.path, {})[o.method.lower()] = operation(o)
    paths["/v1/openapi.json"] = {
        "get": {
            "operationId": "openapi",
            "summary": "This document",
            "tags": ["meta"],
            "security": [],
            "responses": {"200": {"description": "OK", "content": _json({"type": "object"})}},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "sked operator API",
            "version": "1",
            "description": "Read, submit and control tasks and workflows; cordon and drain "
            "nodes. Bearer tokens with roles read < operate < admin (`sked token create`); "
            "every change is audited under the token's name.",
        },
        "paths": paths,
        "components": {
            "schemas": top["$defs"],
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "sked token"}
            },
        },
        "security": [{"bearer": []}],
    }
