"""The API's aiohttp application: every operation of the table behind its role check, and the
OpenAPI document at /v1/openapi.json."""

from __future__ import annotations

from aiohttp import web

from services.api.openapi import document
from services.api.ops import (
    CLIENT,
    OPS,
    POLICY,
    REFUSALS,
    SETTINGS,
    STORE,
    errors,
    guarded,
    refusals,
    reply,
)
from shared.client import SkedClient
from shared.policy import JobPolicy
from shared.settings import Settings
from shared.store import Store


async def openapi(_: web.Request) -> web.StreamResponse:
    return reply(document())


def make_app(settings: Settings, store: Store, client: SkedClient) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=settings.max_message_bytes)
    app[SETTINGS] = settings
    app[STORE] = store
    app[REFUSALS] = refusals()
    app[CLIENT] = client
    app[POLICY] = JobPolicy.of(settings.allowed_handlers, settings.allowed_commands)
    for o in OPS:
        app.router.add_route(o.method, o.path, guarded(o), name=o.handler.__name__)
    app.router.add_route("GET", "/v1/openapi.json", openapi, name="openapi")
    return app
