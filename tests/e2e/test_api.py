"""The operator API end to end: scheduler, relay, two executors and `sked service api` on a
free port, as processes. Tokens from `sked token create`; 401 without one, 403 for a read token
that tries a change; submit, read, pause, resume and cancel with an operate token, each change
named after the token in the task's events and in the audit; a cordoned node takes nothing
while its running work finishes (a drain waits for it); and the CLI through the API, with no
way to the database at all."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from typing import Any

import aiohttp

from shared import workflows
from shared.auth import Role
from shared.store import Store
from tests.e2e.conftest import Deployment
from tests.helpers import SKED, eventually

# the CLI through the API must not need these: they point nowhere
NOWHERE = {
    "SKED_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/nothing",
    "SKED_RABBITMQ_URL": "amqp://nobody:x@127.0.0.1:1/",
    "SKED_REDIS_URL": "redis://127.0.0.1:1/0",
}


def sked(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SKED, *args], env=env, capture_output=True, text=True, timeout=60)


def command(name: str, *argv: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "job": {"kind": "command", "argv": list(argv)}, **kw}


class Api:
    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url = http, url

    async def __call__(
        self, method: str, path: str, token: str | None = None, body: Any = None, **query: Any
    ) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.http.request(
            method, self.url + path, json=body, headers=headers, params=query
        ) as r:
            self.headers = r.headers
            return r.status, await r.json()

    async def status(self, task_id: str, token: str) -> str:
        code, task = await self("GET", f"/v1/tasks/{task_id}", token)
        return str(task["status"]) if code == 200 else f"HTTP {code}"

    async def reached(self, task_id: str, token: str, state: str, timeout: float = 30) -> None:
        seen: list[str] = []

        async def there() -> bool:
            seen.append(await self.status(task_id, token))
            return seen[-1] == state

        try:
            await eventually(there, timeout=timeout, what=f"task {task_id} to be {state}")
        except AssertionError as exc:
            _, task = await self("GET", f"/v1/tasks/{task_id}", token)
            raise AssertionError(f"{exc}; it was {seen[-1]}: {task}") from None

    async def reasons(self, task_id: str, token: str) -> list[str]:
        code, events = await self("GET", f"/v1/tasks/{task_id}/events", token)
        assert code == 200, events
        return [e["reason"] for e in events]


async def test_the_operator_api(
    deployment: Deployment, service_env: dict[str, str], store: Store
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("api-a", 2, "--label", "pool=a")
    await deployment.executor("api-b", 2, "--label", "pool=b")
    proc = await deployment.start("api", "--port", "0", ready="api listening on")
    found = re.search(r"api listening on (http://[\d.]+:\d+)/v1", proc.log())
    assert found, proc.log()
    url = found[1]

    made = sked(service_env, "token", "create", "--role", "operate", "--name", "ops")
    assert made.returncode == 0, made.stderr
    ops = made.stdout.strip()
    assert ops.startswith("sked_")
    assert "shown only now" in made.stderr
    _, viewer = await store.tokens.issue(Role.READ, "viewer")
    via_api = {**service_env, **NOWHERE, "SKED_API_URL": url, "SKED_API_TOKEN": ops}

    async with aiohttp.ClientSession() as http:
        api = Api(http, url)
        # -- who may do what ---------------------------------------------------------------
        for token in (None, "sked_not-a-token"):
            code, body = await api("GET", "/v1/tasks", token)
            assert code == 401, body
            assert api.headers["WWW-Authenticate"].startswith("Bearer")
        code, body = await api("POST", "/v1/tasks", viewer, command("x", "true"))
        assert code == 403, body
        code, body = await api("POST", "/v1/tasks", ops, {"name": "x", "job": {"kind": "?"}})
        assert code == 400
        assert "job" in body["error"]

        # -- submit and read ---------------------------------------------------------------
        code, body = await api("POST", "/v1/tasks", ops, command("hello", "echo", "hi there"))
        assert code == 202, body
        hello = body["id"]
        await api.reached(hello, viewer, "success")
        code, listed = await api("GET", "/v1/tasks", viewer, status="success")
        assert code == 200
        assert [t["id"] for t in listed] == [hello]
        code, log = await api("GET", f"/v1/tasks/{hello}/logs", viewer)
        assert code == 200
        assert "hi there" in log["log"]
        code, body = await api("POST", f"/v1/tasks/{hello}/cancel", viewer)
        assert code == 403, body
        code, body = await api("POST", f"/v1/tasks/{hello}/cancel", ops, {"reason": "late"})
        assert code == 409
        assert "terminal" in body["error"]
        code, body = await api("GET", "/v1/tasks/00000000-0000-0000-0000-000000000000", ops)
        assert code == 404, body

        # -- control, audited under the token's name ---------------------------------------
        code, body = await api("POST", "/v1/tasks", ops, command("nap", "sleep", "60"))
        nap = body["id"]
        await api.reached(nap, ops, "running")
        code, log = await api("GET", f"/v1/tasks/{nap}/logs", viewer)  # asked of its executor
        assert (code, log["status"]) == (200, "running"), log
        code, paused = await api(
            "POST", f"/v1/tasks/{nap}/pause", ops, {"reason": "maintenance", "by": "alice"}
        )
        assert (code, paused["status"]) == (200, "paused"), paused
        assert paused["paused_by"] == "token:ops for alice"
        code, resumed = await api("POST", f"/v1/tasks/{nap}/resume", ops)
        assert code == 200, resumed
        await api.reached(nap, ops, "running")
        # the CLI through the API (no database, broker or Redis reachable): list and cancel
        out = sked(via_api, "list", "--json")
        assert out.returncode == 0, out.stderr
        assert {hello, nap} <= {t["id"] for t in json.loads(out.stdout)}
        # pages: a full one links to the next, after its last task (the API, then the CLI)
        code, first = await api("GET", "/v1/tasks", viewer, limit="1", status="success,running")
        assert (code, [t["id"] for t in first]) == (200, [nap]), first
        following = re.fullmatch(r'<(/v1/tasks\?[^>]+)>; rel="next"', api.headers["Link"])
        assert following, api.headers["Link"]
        code, second = await api("GET", following[1], viewer)
        assert (code, [t["id"] for t in second]) == (200, [hello]), second
        code, body = await api("GET", "/v1/tasks", viewer, after=str(uuid.uuid4()))
        assert code == 404, body
        assert "to list after" in body["error"]
        out = sked(via_api, "list", "--limit", "1", "--status", "success", "--status", "running")
        assert (out.returncode, out.stdout.split()[:1]) == (0, [nap]), out.stderr
        more = re.search(r"more: sked list (.*)", out.stderr)
        assert more, out.stderr
        out = sked(via_api, "list", *more[1].split(), "--json")
        assert [t["id"] for t in json.loads(out.stdout)] == [hello], out.stderr
        out = sked(via_api, "list", "--name", "hello", "--json")
        assert [t["id"] for t in json.loads(out.stdout)] == [hello], out.stderr
        out = sked(via_api, "cancel", nap, "--reason", "enough")
        assert out.returncode == 0, out.stderr
        assert await api.status(nap, ops) == "canceled"
        reasons = await api.reasons(nap, viewer)
        assert "paused by token:ops for alice: maintenance" in reasons
        assert "resumed by token:ops" in reasons
        assert reasons[-1] == "canceled by token:ops: enough"

        # -- cordon and drain --------------------------------------------------------------
        long_task = command("long", "sleep", "3", selector={"pool": "a"})
        code, body = await api("POST", "/v1/tasks", ops, long_task)
        long = body["id"]
        await api.reached(long, ops, "running")
        argv = ["node", "drain", "api-a", "--timeout", "60", "--reason", "kernel update"]
        pipe = asyncio.subprocess.PIPE
        drain = await asyncio.create_subprocess_exec(
            SKED, *argv, env=via_api, stdout=pipe, stderr=pipe
        )

        async def cordoned() -> bool:
            _, nodes = await api("GET", "/v1/nodes", viewer)
            return any(n["id"] == "api-a" and n["cordoned_at"] for n in nodes)

        await eventually(cordoned, timeout=15, what="api-a to be cordoned")
        after_task = command("after", "true", selector={"pool": "a"})
        code, body = await api("POST", "/v1/tasks", ops, after_task)
        after = body["id"]
        out, err = await asyncio.wait_for(drain.communicate(), 60)
        assert drain.returncode == 0, (out, err)
        assert b"drained" in out
        code, task = await api("GET", f"/v1/tasks/{long}", viewer)
        assert (task["status"], task["attempt"]) == ("success", 1)  # ran to its end, untouched
        code, task = await api("GET", f"/v1/tasks/{after}", viewer)
        assert (task["status"], task["node"]) == ("ready", None), task
        assert "cordoned" in task["status_reason"], task
        out = sked(via_api, "nodes")
        assert re.search(r"api-a\s+cordoned", out.stdout), out.stdout + out.stderr

        code, node = await api("POST", "/v1/nodes/api-a/uncordon", ops)
        assert code == 200
        assert node["cordoned_at"] is None
        await api.reached(after, ops, "success")
        code, task = await api("GET", f"/v1/tasks/{after}", viewer)
        assert task["node"] == "api-a"
        code, body = await api("POST", "/v1/nodes/nope/cordon", ops)
        assert code == 404, body

        # -- a workflow canceled whole: the CLI through the API ------------------------------
        pair = {
            "name": "pair",
            "tasks": [
                {"name": "long", "command": ["sleep", "60"]},
                {"name": "next", "command": ["true"], "needs": ["long"]},
            ],
        }
        code, body = await api("POST", "/v1/workflows", ops, pair)
        assert code == 202, body
        wf = body["id"]
        long_id = str(workflows.task_id(uuid.UUID(wf), "long"))
        await api.reached(long_id, ops, "running")
        out = sked(via_api, "pause-workflow", wf, "--reason", "maintenance", "--json")
        assert out.returncode == 0, out.stderr
        assert sorted((t["wf_task"], t["status"]) for t in json.loads(out.stdout)) == [
            ("long", "paused"),
            ("next", "paused"),
        ]
        out = sked(via_api, "resume-workflow", wf, "--json")
        assert out.returncode == 0, out.stderr
        assert {t["wf_task"]: t["status"] for t in json.loads(out.stdout)}["next"] == "pending"
        await api.reached(long_id, ops, "running")  # a new attempt
        code, task = await api("GET", f"/v1/tasks/{long_id}", viewer)
        assert task["attempt"] == 2, task
        out = sked(via_api, "cancel-workflow", wf, "--reason", "obsolete", "--json")
        assert out.returncode == 0, out.stderr
        assert sorted((t["wf_task"], t["status"]) for t in json.loads(out.stdout)) == [
            ("long", "canceled"),
            ("next", "canceled"),
        ]
        code, view = await api("GET", f"/v1/workflows/{wf}", viewer)
        assert (code, view["status"]) == (200, "canceled"), view
        assert (await api.reasons(long_id, viewer))[-1] == (
            f"canceled with workflow {wf} by token:ops: obsolete"
        )
        code, body = await api("POST", f"/v1/workflows/{wf}/cancel", ops)
        assert code == 409, body
        out = sked(via_api, "workflows", "--name", "pair", "--json")
        assert out.returncode == 0, out.stderr
        assert [(w["id"], w["status"]) for w in json.loads(out.stdout)] == [(wf, "canceled")]
        assert "has ended" in body["error"]

        # -- the audit ---------------------------------------------------------------------
        code, body = await api("GET", "/v1/audit", ops)
        assert code == 403, body
    audit = [(e.token, e.action, e.target) for e in await store.tokens.audit_log()]
    assert ("ops", "submit", hello) in audit
    for action in ("pause", "resume", "cancel"):
        assert ("ops", action, nap) in audit
    assert ("ops", "drain", "api-a") in audit
    for action in ("pause-workflow", "resume-workflow", "cancel-workflow"):
        assert ("ops", action, wf) in audit
    assert ("ops", "uncordon", "api-a") in audit
    assert not [a for a in audit if a[0] == "viewer"]  # its refused calls changed nothing
