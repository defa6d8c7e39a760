"""The operator API against hostile requests, on the real store, Redis and RabbitMQ: each a
request that once got a 500 or did what it must not, now a clear 4xx that changes nothing.
The app is `make_app` on the service's own backends, as `sked service api` builds it
(services/api/service.py), served in-process by aiohttp's test server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.api.app import make_app
from services.api.service import BorrowedClient
from shared.auth import Role
from shared.settings import Settings
from shared.store import Store
from shared.wiring import backends
from tests.helpers import spec


class Api:
    def __init__(self, http: TestClient[Any, Any], store: Store) -> None:
        self.http, self.store = http, store
        self.secrets: dict[Role, str] = {}

    def auth(self, role: Role) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets[role]}"}

    async def raw(self, request: bytes) -> bytes:
        """One request written as raw bytes (what a client library would not send)."""
        reader, writer = await asyncio.open_connection(self.http.host, self.http.port)
        try:
            writer.write(request)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[Api]:
    async with backends(settings) as b:
        app = make_app(settings, b.store, BorrowedClient(b))
        async with TestClient(TestServer(app)) as http:
            a = Api(http, b.store)
            for role in Role:
                _, a.secrets[role] = await b.store.tokens.issue(role, f"t-{role.value}")
            yield a


# -- query parameters --------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/workflows", "/v1/dead", "/v1/audit"])
async def test_a_limit_of_non_ascii_or_too_many_digits_is_a_400(api: Api, path: str) -> None:
    """A limit of '²' (a digit to str.isdigit(), not to int()) or of 5,000 '9's (past
    Python's integer-string limit) is a 400 naming the limit, not a ValueError's 500."""
    for limit in ("\u00b2", "9" * 5000):
        async with api.http.get(path, params={"limit": limit}, headers=api.auth(Role.ADMIN)) as r:
            assert r.status == 400, (path, limit[:10], r.status, await r.text())
            assert "limit" in (await r.json())["error"]


# -- path parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v1/nodes/a%00b/cordon", "/v1/nodes/a%00b/uncordon", "/v1/tokens/a%00b/revoke"]
)
async def test_a_nul_in_a_node_or_token_name_is_a_4xx(api: Api, path: str) -> None:
    """A path's parts are checked for what Postgres cannot hold, as query parameters are
    (ops.guarded): a NUL in a node id or token name never reaches asyncpg, whose
    CharacterNotInRepertoireError was answered 500."""
    async with api.http.post(path, headers=api.auth(Role.ADMIN)) as r:
        assert r.status in (400, 404), (path, r.status, await r.text())


# -- tokens ------------------------------------------------------------------------------------


async def test_a_token_name_ending_in_a_newline_is_a_400(api: Api) -> None:
    """A token name is matched whole: with match() and `$` (which in Python also matches
    before a final newline) 'ci\\n' passed check_name, and Postgres's CHECK refused the row
    with a 500."""
    body = {"role": "read", "name": "ci\n"}
    async with api.http.post("/v1/tokens", json=body, headers=api.auth(Role.ADMIN)) as r:
        assert r.status == 400, (r.status, await r.text())
        assert "token name" in (await r.json())["error"]
    assert [t.name for t in await api.store.tokens.all() if t.name.startswith("ci")] == []


async def test_an_authorization_header_that_is_not_utf8_is_a_401(api: Api) -> None:
    """aiohttp keeps a header's undecodable bytes as lone surrogates, which no digest can
    encode: such a token is unknown (401 with a Bearer challenge), not a 500."""
    answer = await api.raw(
        b"GET /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Authorization: Bearer sked_\xff\xfe\r\n\r\n"
    )
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 401"), answer[:400]
    assert b"WWW-Authenticate: Bearer" in answer


# -- bodies ------------------------------------------------------------------------------------


async def test_on_behalf_of_cannot_forge_a_line_of_the_task_history(api: Api) -> None:
    """`by` ("on whose behalf; recorded after the token's name") is one line of printable
    text: a line break in it would write, into the task's event and paused_by, a line that
    reads as an action by another token."""
    task = await api.store.tasks.create(spec("victim"))
    forged = "alice\ncreated -> Canceled  canceled by token:t-admin"
    body = {"reason": "maintenance", "by": forged}
    async with api.http.post(
        f"/v1/tasks/{task.id}/pause", json=body, headers=api.auth(Role.OPERATE)
    ) as r:
        status, text = r.status, await r.text()
    reasons = [e.reason for e in await api.store.tasks.history(task.id)]
    assert status == 400, (status, text, reasons)
    assert not any("\n" in reason for reason in reasons), reasons


async def test_a_priority_must_be_an_integer_not_a_boolean(api: Api) -> None:
    """A priority is a JSON integer, as the OpenAPI document says: a lax int took `true` as
    priority 1 (and "7" as 7), and the audit recorded a client's bug as a deliberate change."""
    task = await api.store.tasks.create(spec("p"))
    async with api.http.post(
        f"/v1/tasks/{task.id}/priority", json={"priority": True}, headers=api.auth(Role.OPERATE)
    ) as r:
        assert r.status == 400, (r.status, (await r.text())[:200])
    assert (await api.store.tasks.get(task.id)).priority == 0


async def test_an_allowed_command_directory_cannot_be_left_with_dotdot(
    settings: Settings,
) -> None:
    """SKED_ALLOWED_COMMANDS=/opt/jobs/ allows "every program in it" (README), judged by the
    path's prefix only for a normal path: '/opt/jobs/../../bin/sh' starts with '/opt/jobs/'
    and was accepted (202), running /bin/sh. (Intake and the executor use the same
    JobPolicy.refuses.)"""
    narrowed = settings.model_copy(update={"allowed_commands": ["/opt/jobs/"]})
    async with backends(narrowed) as b:
        app = make_app(narrowed, b.store, BorrowedClient(b))
        _, secret = await b.store.tokens.issue(Role.OPERATE, "ops")
        headers = {"Authorization": f"Bearer {secret}"}
        async with TestClient(TestServer(app)) as http:
            plain = {"name": "sh", "job": {"kind": "command", "argv": ["/bin/sh", "-c", "id"]}}
            async with http.post("/v1/tasks", json=plain, headers=headers) as r:
                assert r.status == 400, await r.text()  # the allowlist holds for /bin/sh...
            escaped = {
                "name": "sh",
                "job": {"kind": "command", "argv": ["/opt/jobs/../../bin/sh", "-c", "id"]},
            }
            async with http.post("/v1/tasks", json=escaped, headers=headers) as r:
                assert r.status == 400, (r.status, await r.text())  # ...but not for this
