"""The client side — SDK, HTTP API client, sync client, CLI — against hostile or broken
peers and callers: each case was found by an adversarial review (an endless or compressed
answer read whole, a wait that busy-looped or outran its timeout, a redirect followed, an id
that reached another path, a FIFO that hung the CLI, a traceback or escapes printed). The
docstrings say what happened; each test shows it no longer does."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest
from aiohttp import web

from shared.api_client import ApiClient
from shared.errors import SkedError

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "probe-secret-token-0123456789"
# Nothing a probe does may reach a real deployment: every server URL points at a closed port.
SAFE_ENV = {
    "SKED_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/nope",
    "SKED_RABBITMQ_URL": "amqp://guest:guest@127.0.0.1:1/nope",
    "SKED_REDIS_URL": "redis://127.0.0.1:1/0",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def api_server(handler: Handler) -> AsyncIterator[str]:
    """An HTTP server on 127.0.0.1 that answers every request with `handler`."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def task_json(task_id: UUID, **kw: Any) -> dict[str, Any]:
    """A task as GET /v1/tasks/{id} answers it."""
    now = datetime.now(UTC).isoformat()
    data: dict[str, Any] = {
        "id": str(task_id),
        "name": "t",
        "kind": "command",
        "spec": {"name": "t", "job": {"kind": "command", "argv": ["true"]}, "priority": 0},
        "status": "running",
        "status_reason": "",
        "version": 1,
        "attempt": 1,
        "priority": 0,
        "retry_count": 0,
        "max_retries": 0,
        "next_retry_at": None,
        "timeout_s": None,
        "heartbeat_timeout_s": 30.0,
        "node": None,
        "idempotency_key": None,
        "paused_by": None,
        "paused_reason": None,
        "paused_at": None,
        "result": None,
        "error": None,
        "created_at": now,
        "updated_at": now,
        "queued_at": None,
        "started_at": None,
        "finished_at": None,
        "log_tail": None,
        "cpu": 0.0,
        "memory_mb": 0,
        "gpu": 0,
        "traceparent": None,
        "hb_at": None,
        "hb_deadline": None,
        "hb_seq": 0,
        "workflow_id": None,
        "wf_task": None,
        "uses": [],
    }
    data.update(kw)
    return data


def node_json(**kw: Any) -> dict[str, Any]:
    now = datetime.now(UTC).isoformat()
    data: dict[str, Any] = {
        "id": "n1",
        "slots": 2,
        "cpu": 2.0,
        "memory_mb": 1024,
        "gpu": 0,
        "labels": {},
        "ready": True,
        "live": True,
        "load": 0.0,
        "boot_id": str(uuid4()),
        "registered_at": now,
        "heartbeat_at": now,
        "used_slots": 0,
        "used_cpu": 0.0,
        "used_memory_mb": 0,
        "used_gpu": 0,
        "cordoned_at": None,
        "cordoned_by": None,
        "cordon_reason": None,
        "prefetch": 0,
    }
    data.update(kw)
    return data


def cli_env(api_url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKED_")}
    env.update(SAFE_ENV)
    env["PYTHONPATH"] = str(ROOT)
    if api_url is not None:
        env.update(SKED_API_URL=api_url, SKED_API_TOKEN=TOKEN)
    return env


async def sked_async(env: dict[str, str], *args: str, timeout: float = 30) -> tuple[int, str, str]:
    """`python -m services.cli ARGS` as a subprocess (the test's loop keeps serving meanwhile)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        *args,
        env=env,
        cwd=str(ROOT),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def sked(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- the HTTP API client against a hostile server --------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [[], {}, {"error": "the database is down"}, {"id": 5}, task_json(uuid4(), created_at=5)],
    ids=["list", "empty-object", "200-with-error-body", "id-an-int", "created_at-an-int"],
)
async def test_api_client_answer_of_the_wrong_shape_is_a_clear_error(answer: Any) -> None:
    """A 200 whose JSON is not a task (a list, missing keys, an error body, wrong types) must
    raise SkedError naming the bad answer, not a bare TypeError/KeyError/ValueError."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(answer)

    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        with pytest.raises(SkedError):
            await client.get(uuid4())


async def test_cli_status_through_an_api_answering_a_list_is_not_a_traceback() -> None:
    """`sked status ID` through an API that answers `[]`: a one-line error, exit 2."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response([])

    async with api_server(handler) as url:
        code, _out, err = await sked_async(cli_env(url), "status", str(uuid4()))
    assert "Traceback" not in err, err
    assert code == 2, (code, err)
    assert err.startswith("sked: "), (code, err)


async def test_api_client_does_not_follow_a_redirect_to_another_server() -> None:
    """A 307 from the API to another origin: the submission (its spec, env and all) must not
    be re-sent there, nor an id that server made up be taken as the task's."""
    seen: list[str] = []

    async def other(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path} {await request.text()}")
        return web.json_response({"id": str(uuid4())})

    async with api_server(other) as other_url:

        async def handler(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(other_url + request.path)

        async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
            spec = {"name": "x", "job": {"kind": "command", "argv": ["true"], "env": {"K": "s"}}}
            with pytest.raises(SkedError):
                await client.submit(spec)
    assert seen == [], seen


async def test_api_client_reads_no_more_than_a_bounded_answer() -> None:
    """A server streaming an endless (here 256 MB) body: the client must give up after a
    bounded number of bytes, not buffer all of it (`r.text()` has no cap)."""
    sent = 0
    chunk = b" " * (1 << 20)

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        try:
            for _ in range(256):
                await resp.write(chunk)
                sent += len(chunk)
        except (ConnectionResetError, ConnectionError):
            pass
        return resp

    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        with pytest.raises(SkedError):
            await asyncio.wait_for(client.get(uuid4()), 30)
    assert sent <= 32 << 20, f"the client read {sent >> 20} MB of one answer"


async def test_api_client_wait_ends_by_its_timeout_against_a_slow_server() -> None:
    """wait(timeout=0.5) against an API that takes 10 s to answer: each request is bounded by
    the client's 60 s, not by the wait's deadline, so the wait overruns its timeout."""

    async def handler(request: web.Request) -> web.Response:
        await asyncio.sleep(10)
        return web.json_response(task_json(UUID(request.path.rsplit("/", 1)[-1])))

    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        started = time.monotonic()
        with pytest.raises(SkedError):  # WaitTimeout is one
            await asyncio.wait_for(client.wait(uuid4(), timeout=0.5), 4)
        assert time.monotonic() - started < 2.5


async def test_api_client_wait_of_nan_seconds_is_refused_not_endless() -> None:
    """SkedClient refuses a NaN timeout (InvalidSpec); ApiClient's wait_all compares
    `monotonic() > nan`, never true, and polls forever."""
    from shared.errors import InvalidSpec

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(task_json(UUID(request.path.rsplit("/", 1)[-1])))

    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        with pytest.raises(InvalidSpec):
            await asyncio.wait_for(client.wait(uuid4(), timeout=math.nan), 3)


# -- the CLI prints what others wrote inert --------------------------------------------------

ESC = "\x1b]0;pwned\x07\x1b[2J"  # set the terminal's title, clear the screen


async def test_cli_error_from_the_api_is_printed_inert() -> None:
    """`sked status ID` through an API whose 404 says `{"error": "<escapes>"}`: main() prints
    `masked(str(exc))`, never `printable`, so the terminal acts on the escapes."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"error": f"no task{ESC}\nsked: forged line"}, status=404)

    async with api_server(handler) as url:
        code, _out, err = await sked_async(cli_env(url), "status", str(uuid4()))
    assert code == 2, err
    assert "\x1b" not in err, repr(err)
    assert "\x07" not in err, repr(err)
    assert err.count("\n") == 1, repr(err)


async def test_cli_submit_wait_prints_the_tasks_error_inert() -> None:
    """`sked submit --wait` prints `{label}: {task.error or task.result}` as it is: a task's
    own error output (anyone's text) reaches the terminal with its escapes and line breaks."""
    ident: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        if request.method == "POST":
            ident.append(str(uuid4()))
            return web.json_response({"id": ident[0]})
        error = f"boom{ESC}\nSUCCESS: all good"
        return web.json_response(task_json(UUID(ident[0]), status="failed", error=error))

    async with api_server(handler) as url:
        code, out, err = await sked_async(cli_env(url), "submit", "--command", "true", "--wait")
    assert code == 1, (out, err)
    assert "\x1b" not in out, repr(out)
    assert "\x07" not in out, repr(out)
    assert out.count("\n") == 2, repr(out)


async def test_cli_nodes_prints_node_labels_inert() -> None:
    """`sked nodes` prints each node's id and labels (set by whoever runs an executor) raw,
    unlike every other listing, which passes others' text through `printable`."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response([node_json(labels={"zone": f"a{ESC}\nn2 ready slots 9/9"})])

    async with api_server(handler) as url:
        code, out, err = await sked_async(cli_env(url), "nodes")
    assert code == 0, err
    assert "\x1b" not in out, repr(out)
    assert "\x07" not in out, repr(out)
    assert out.count("\n") == 1, repr(out)


async def test_cli_json_output_is_valid_json_when_the_api_says_nan() -> None:
    """`sked status ID --json` through an API answering `"result": NaN` (which json.loads
    takes) prints `NaN`: not JSON, so a pipe to jq breaks. `--json` must be strict JSON."""
    body = json.dumps(task_json(uuid4(), status="success", result={"x": math.nan}))

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=body, content_type="application/json")

    async with api_server(handler) as url:
        code, out, err = await sked_async(cli_env(url), "status", str(uuid4()), "--json")

    def strict(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    if code == 0:
        json.loads(out, parse_constant=strict)
    else:  # refusing the answer is fine too, if said clearly
        assert err.startswith("sked: "), err
        assert "Traceback" not in err, err


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ("<html><body>" + "<p>Bad Gateway</p>" * 100_000 + "</body></html>", "text/html"),
        (json.dumps(["Bad Gateway"] * 100_000), "application/json"),
    ],
    ids=["html", "json-list"],
)
async def test_cli_error_from_a_502_says_the_status_and_is_bounded(body: str, kind: str) -> None:
    """A proxy's 502 in front of the API: the error must name HTTP 502, in a bounded line.
    HTML: json.loads fails first and the CLI says `the API ... did not answer: Expecting
    value: line 1 column 1 (char 0)`, the status lost; a JSON non-object: the whole body
    (here 1.5 MB) becomes the message printed to stderr."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=body, status=502, content_type=kind)

    async with api_server(handler) as url:
        code, _out, err = await sked_async(cli_env(url), "status", str(uuid4()))
    assert code == 2, err[:300]
    assert "502" in err, (len(err), err[:300])
    assert len(err) < 10_000, (len(err), err[:300])


# -- the CLI's own input ---------------------------------------------------------------------


def refused_clearly(done: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in done.stderr, done.stderr[-600:]
    assert done.returncode == 2, done.stderr[-600:]
    assert done.stderr.startswith("sked: "), done.stderr[-600:]


def test_cli_submit_command_with_an_unclosed_quote_is_a_clear_error() -> None:
    """`sked submit --command 'echo "hi'`: shlex.split's ValueError escapes as a traceback."""
    refused_clearly(sked(cli_env(), "submit", "--command", 'echo "hi'))


def test_cli_submit_handler_args_nested_deep_is_a_clear_error() -> None:
    """`sked submit --handler m:f --args '[[[...]]]'` 5,000 deep: spec_from_args catches only
    JSONDecodeError, and json.loads's RecursionError escapes as a traceback."""
    refused_clearly(
        sked(cli_env(), "submit", "--handler", "m:f", "--args", "[" * 5000 + "]" * 5000)
    )


@pytest.mark.parametrize(
    "text", ["[" * 50_000 + "]" * 50_000, '{"a":' * 50_000 + "1" + "}" * 50_000]
)
def test_cli_workflow_file_nested_deep_is_a_clear_error(tmp_path: Path, text: str) -> None:
    """A 100 KB workflow file nested 50,000 deep: PyYAML's composer recurses and the CLI
    prints a RecursionError traceback (the values counter runs only after loading)."""
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    refused_clearly(sked(cli_env(), "submit-workflow", str(path)))


def test_cli_workflow_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    """`sked submit-workflow FIFO` (or /dev/stdin of a terminal, a socket...): read_text blocks
    until a writer comes and goes, forever here. A workflow file must be a regular file."""
    fifo = tmp_path / "wf.yaml"
    os.mkfifo(fifo)
    try:
        done = sked(cli_env(), "submit-workflow", str(fifo), timeout=6)
    except subprocess.TimeoutExpired:
        pytest.fail("sked submit-workflow on a FIFO was still waiting after 6 s")
    refused_clearly(done)


def test_cli_workflow_file_far_over_a_message_is_refused_in_bounded_time(tmp_path: Path) -> None:
    """A 16 MB workflow file (16 times what one message may carry): the whole file is read and
    parsed by the pure-Python YAML loader (about 10 s per MB of small values) before anything
    is checked; it should be refused at once by its size."""
    path = tmp_path / "big.yaml"
    with path.open("w") as f:
        f.write("name: x\ntasks: [")
        f.write("1," * (8 << 20))
        f.write("1]\n")
    started = time.monotonic()
    try:
        done = sked(cli_env(), "submit-workflow", str(path), timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("a 16 MB workflow file was still being parsed after 10 s")
    refused_clearly(done)
    assert time.monotonic() - started < 10


# -- the SDK ---------------------------------------------------------------------------------


async def test_sync_client_shared_by_two_threads_at_once(settings: Any) -> None:
    """Two threads each waiting on one SyncSkedClient: both calls run_until_complete on its one
    private loop, and the second raises RuntimeError('This event loop is already running')
    instead of waiting (or a clear error saying the client is not thread-safe)."""
    from shared.client import WaitTimeout
    from shared.sync_client import SyncSkedClient

    errors: list[BaseException] = []

    def waits(sked: SyncSkedClient) -> None:
        try:
            sked.wait(uuid4(), timeout=1.0)
        except BaseException as exc:
            errors.append(exc)

    def both() -> None:
        with SyncSkedClient(settings) as sked:
            sked.tasks(limit=1)  # connected
            threads = [threading.Thread(target=waits, args=(sked,)) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)

    await asyncio.to_thread(both)
    assert len(errors) == 2
    assert all(isinstance(e, WaitTimeout | SkedError) for e in errors), errors


async def test_sync_client_closed_twice_is_harmless(settings: Any) -> None:
    """close() then leaving the `with` (or any second close): run_until_complete on the closed
    loop raises RuntimeError('Event loop is closed'). A close must be idempotent."""
    from shared.sync_client import SyncSkedClient

    def twice() -> None:
        with SyncSkedClient(settings) as sked:
            sked.tasks(limit=1)
            sked.close()

    await asyncio.to_thread(twice)


async def test_api_client_ids_cannot_reach_another_path() -> None:
    """ApiClient puts a str id into the path as it is (SkedClient parses it as a UUID first):
    cancel_workflow("../tasks/<id>") sends POST /v1/tasks/<id>/cancel, cancelling a task
    that is no workflow of the caller's; a node name with "../" goes elsewhere likewise."""
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path}")
        return web.json_response([])

    victim = uuid4()
    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        with pytest.raises(SkedError):
            await client.cancel_workflow(f"../tasks/{victim}", "r")
    assert f"POST /v1/tasks/{victim}/cancel" not in seen, seen


@pytest.mark.parametrize(
    "call",
    [
        "wait-not-a-uuid",
        "wait_all-one-str",
        "get-bytes",
        "set_priority-str",
        "pause-reason-None",
    ],
)
async def test_sdk_bad_arguments_are_sked_errors(settings: Any, call: str) -> None:
    """SkedClient given a malformed id or argument raises a bare ValueError ('badly formed
    hexadecimal UUID string', even for wait_all(one_valid_id_str), which iterates its
    characters) or TypeError ('<=' not supported..., 'NoneType' is not iterable), not
    InvalidSpec/SkedError naming the argument."""
    from shared.client import SkedClient

    async with SkedClient(settings) as c:
        calls = {
            "wait-not-a-uuid": lambda: c.wait("nope", 0.1),
            "wait_all-one-str": lambda: c.wait_all(str(uuid4()), 0.1),
            "get-bytes": lambda: c.get(uuid4().bytes),  # type: ignore[arg-type]
            "set_priority-str": lambda: c.set_priority(uuid4(), "5"),  # type: ignore[arg-type]
            "pause-reason-None": lambda: c.pause(uuid4(), None),  # type: ignore[arg-type]
        }
        with pytest.raises(SkedError):
            await asyncio.wait_for(calls[call](), 5)


@pytest.mark.parametrize("limit", [-1, 10**20])
async def test_sdk_listing_limit_out_of_range_is_a_sked_error(settings: Any, limit: int) -> None:
    """tasks(limit=-1) and tasks(limit=10**20) reach Postgres/asyncpg as they are and come
    back as asyncpg's InvalidRowCountInLimitClauseError / DataError, not InvalidSpec."""
    from shared.client import SkedClient

    async with SkedClient(settings) as c:
        with pytest.raises(SkedError):
            await c.tasks(limit=limit)


async def test_cli_workflow_dot_quotes_what_producers_named() -> None:
    """`sked workflow ID --dot` writes the workflow's and its tasks' names (any producer's
    text, up to 200 characters) between DOT quotes as they are: a `"` ends the string and the
    rest becomes DOT statements (attributes such as URL= that an SVG renders), and terminal
    escapes go out raw."""
    wf, a = uuid4(), uuid4()
    name = f'x" {{ evil [URL="javascript:alert(1)"] }} digraph "y{ESC}'
    view = {
        "id": str(wf),
        "name": name,
        "tasks": [task_json(a, workflow_id=str(wf), wf_task='a"] evil2 [URL="x')],
        "edges": [],
    }

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(view)

    async with api_server(handler) as url:
        code, out, err = await sked_async(cli_env(url), "workflow", str(wf), "--dot")
    assert code == 0, err
    assert "\x1b" not in out, repr(out)
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', out)  # what lies outside DOT strings
    assert "evil" not in outside, outside
    assert "URL" not in outside, outside


async def test_api_client_drain_does_not_busy_loop_on_an_early_answer() -> None:
    """drain(timeout=1) against an API that answers "still held" at once (a proxy cutting the
    long poll, an older API ignoring ?wait=): ApiClient.drain re-asks with no pause at all,
    hundreds of requests a second, until its deadline (forever with timeout=None)."""
    asked = 0
    holder = str(uuid4())

    async def handler(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        return web.json_response({"node": node_json(), "holding": [holder]})

    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        done = await asyncio.wait_for(client.drain("n1", timeout=1.0), 10)
    assert not done.done
    assert asked <= 20, f"{asked} drain requests in 1 s"


async def test_sdk_revalidates_a_task_spec_built_by_its_constructor(settings: Any) -> None:
    """`TaskSpec(...)` validates without the NEW context, so the new-spec bounds (here a
    selector of 100 labels; at most 64) are skipped; submit() takes a TaskSpec instance as
    valid and publishes it. Intake (TaskSpec.parse) dead-letters it, yet the caller got an id,
    and wait(id) waits for a task that will never exist. submit must raise InvalidSpec."""
    from shared.client import SkedClient
    from shared.errors import InvalidSpec
    from shared.models import TaskSpec

    spec = TaskSpec(
        name="x",
        job={"kind": "command", "argv": ["true"]},  # type: ignore[arg-type]
        selector={f"k{i}": "v" for i in range(100)},
    )
    async with SkedClient(settings) as client:
        with pytest.raises(InvalidSpec):
            await client.submit(spec)


async def test_sdk_checks_a_workflow_spec_built_by_its_constructor(settings: Any) -> None:
    """WorkflowSpec(...) (or model_validate) never runs check(): submit_workflow takes the
    instance as valid and publishes a workflow whose tasks need each other, though its own
    docstring says "a cycle raises InvalidSpec naming it, and nothing is sent"."""
    from shared.client import SkedClient
    from shared.dag import WorkflowSpec
    from shared.errors import InvalidSpec

    spec = WorkflowSpec(
        name="loop",
        tasks=[  # type: ignore[list-item]
            {"name": "a", "command": ["true"], "needs": ["b"]},
            {"name": "b", "command": ["true"], "needs": ["a"]},
        ],
    )
    async with SkedClient(settings) as client:
        with pytest.raises(InvalidSpec, match=r"cycle|a -> b|b -> a"):
            await client.submit_workflow(spec)


async def test_api_client_wait_for_thousands_of_ids_ends_by_its_timeout() -> None:
    """wait_all(5000 ids, timeout=0.5) against a fast API: each round GETs every pending task
    one by one and the deadline is looked at only after the whole round, so the wait takes
    seconds past its timeout (a request per task per round; no batch read, no concurrency)."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(task_json(UUID(request.path.rsplit("/", 1)[-1])))

    ids = [uuid4() for _ in range(5000)]
    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        started = time.monotonic()
        with pytest.raises(SkedError):
            await asyncio.wait_for(client.wait_all(ids, timeout=0.5), 20)
        took = time.monotonic() - started
    assert took < 1.2, f"a wait of 0.5 s took {took:.1f} s"


async def test_api_client_bounds_a_compressed_answer_by_its_decoded_size() -> None:
    """A 250 KB gzip body that inflates to 256 MB (aiohttp decompresses on its own): the
    client holds all of it, then its text, before json.loads refuses it. Peak memory of one
    answer must stay bounded (here: under 64 MB)."""
    import gzip
    import tracemalloc

    bomb = gzip.compress(b" " * (256 << 20), compresslevel=9)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(
            body=bomb,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )

    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        tracemalloc.start()
        try:
            with pytest.raises(SkedError):
                await asyncio.wait_for(client.get(uuid4()), 30)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 64 << 20, f"one answer peaked at {peak >> 20} MB"


async def test_api_client_wait_workflow_not_admitted_in_time_is_a_wait_timeout() -> None:
    """SkedClient.wait_workflow on a workflow not admitted by its timeout raises WaitTimeout
    (`sked submit-workflow --wait` exits 1); ApiClient re-raises the 404 as NotFound, so the
    same command through the API exits 2 ('no workflow ...') as if the id were wrong."""
    from shared.client import WaitTimeout

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"error": "no workflow"}, status=404)

    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        with pytest.raises(WaitTimeout):
            await asyncio.wait_for(client.wait_workflow(uuid4(), timeout=0.3), 5)
