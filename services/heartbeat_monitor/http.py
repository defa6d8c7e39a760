"""`POST /heartbeat` (a task's own process beats; bearer token per attempt) and `GET /healthz`.
401 without a token, 403 with another attempt's, 400 for a body that is not a valid beat,
503 when shedding, 202 otherwise: whether a beat is applied is decided in bulk by the flush."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from pydantic import ValidationError

from services.heartbeat_monitor.beats import Beats
from shared import heartbeat
from shared.heartbeat import Beat
from shared.throttle import Throttled

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
# Every task's process can reach this endpoint, so no connection may be held for free: one
# that sends nothing (or stays idle after its answer) is closed after IDLE_S — aiohttp's own
# default is an hour — and a body must arrive within BODY_S.
IDLE_S = 10.0
BODY_S = 5.0


def runner(app: web.Application) -> web.AppRunner:
    """The endpoint's runner: idle connections closed after IDLE_S."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=IDLE_S)


def make_app(beats: Beats, secret: str) -> web.Application:
    bad_token = Throttled(log)  # every task's process can reach this endpoint: no log flood

    async def beat(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            beats.refused()
            return web.json_response({"error": "missing bearer token"}, status=401)
        try:
            async with asyncio.timeout(BODY_S):
                body = await request.read()
        except TimeoutError:
            beats.refused()
            return web.json_response({"error": "the body came too slowly"}, status=408)
        try:
            got = Beat.model_validate_json(body)
        except ValidationError as exc:
            beats.refused()
            return web.json_response({"error": str(exc)}, status=400)
        if not heartbeat.token_ok(secret, got.task_id, got.attempt, auth[len("Bearer ") :]):
            beats.refused()
            bad_token.warning("heartbeat for %s attempt %d: bad token", got.task_id, got.attempt)
            return web.json_response({"error": "token does not match this attempt"}, status=403)
        if beats.take([got]):
            return web.json_response({"accepted": False, "error": "overloaded"}, status=503)
        return web.json_response({"accepted": True}, status=202)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, **beats.stats, "pending": len(beats.pending)})

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/heartbeat", beat)
    app.router.add_get("/healthz", healthz)
    return app
