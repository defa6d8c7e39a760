"""The `sked` CLI as an operator uses it, against hostile or broken servers and data. Each case
was found by an adversarial review and failed before its fix; the docstrings say what
happened, and the fix."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from uuid import uuid4

import asyncpg
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.api.app import make_app
from services.api.service import BorrowedClient
from shared.auth import Role
from shared.settings import Settings
from shared.wiring import backends
from tests.helpers import SKED, spec
from tests.integration import test_client_hostile as hostile


async def cli(env: dict[str, str], *args: str, limit: float = 60.0) -> tuple[int | None, str, str]:
    """`sked ARGS` as a subprocess (the test's loop keeps serving meanwhile): exit code, stdout,
    stderr; (None, "", "") if it had not ended after `limit` s (then it is killed)."""
    proc = await asyncio.create_subprocess_exec(
        SKED, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(limit):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None, "", ""
    return proc.returncode, out.decode(), err.decode()


def bare_env(**sked: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKED_")}
    env.update({f"SKED_{k}": v for k, v in sked.items()})
    return env


# -- the operator API client ----------------------------------------------------------------


async def test_an_api_answer_larger_than_one_read_is_read_whole(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """Through the operator API (SKED_API_URL + SKED_API_TOKEN), `sked list` of 50 tasks
    (the default page) whose specs are ~2 KB each, and `sked status` of a task whose result is
    200 KB (results may be up to 1 MB), fail with "the API answered ... with a body that is
    not JSON", exit 2 — against sked's own, healthy API.

    Why: shared/api_client.py ApiClient.call reads the body with
    `await r.content.read(MAX_ANSWER_BYTES + 1)`. aiohttp's StreamReader.read(n) returns *at
    most* n bytes — whatever is buffered once some data has arrived (typically one 64 KiB
    chunk) — not the body up to n. Every answer past one socket read is cut and parsed as
    truncated JSON. The operator is told the API is broken when it is not, and cannot list or
    read tasks through the API at all once they are of an ordinary size.

    Now the answer is read to its end, bounded by MAX_ANSWER_BYTES."""
    async with backends(settings) as b:
        app = make_app(settings, b.store, BorrowedClient(b))
        async with TestClient(TestServer(app)) as http:
            _, secret = await b.store.tokens.issue(Role("read"), "reader")
            job = {"kind": "command", "argv": ["echo", "x" * 2000]}
            for _ in range(50):
                await b.store.tasks.create(spec("big", job=job))
            one = await b.store.tasks.create(spec("result"))
            await pool.execute(
                "UPDATE tasks SET result = $2::jsonb WHERE id = $1",
                one.id,
                '{"rows": "' + "r" * 200_000 + '"}',
            )
            env = bare_env(API_URL=f"http://{http.host}:{http.port}", API_TOKEN=secret)
            listed = await cli(env, "list")
            status = await cli(env, "status", str(one.id))
    assert listed[0] == 0, listed[2]
    assert len(listed[1].splitlines()) == 50
    assert status[0] == 0, status[2]
    assert "r" * 1000 in status[1]


async def test_a_hostile_api_answer_is_a_clear_error_not_a_traceback() -> None:
    """A broken or hostile API answers `GET /v1/tasks` with a task whose `attempt` is an object
    or whose `name` is a number, or `GET /v1/workflows` with a count keyed by something that is
    no state: `sked list` / `sked workflows` print a Python traceback (TypeError,
    AttributeError, ValueError) and exit 2, where the CLI promises a one-line error naming the
    bad answer (shared/api_answers.read_answer exists for exactly this).

    Why: api_answers.from_json converts only datetimes, UUIDs and states; other fields are
    taken as they come, and the failure surfaces later, in services/cli/commands.py _list
    (`f"{t.attempt:>3}"`, `printable(t.name)`) and _workflows (`State(s)` on a count key),
    outside read_answer.

    Now from_json checks each field's type against its annotation (a bool is no number) and
    a WorkflowSummary's counts are states, so any mismatch is "the API answered ...
    unexpected body"."""
    tid = uuid4()
    summary = {
        "id": str(tid),
        "name": "w",
        "created_at": "2026-01-01T00:00:00+00:00",
        "counts": {"\x1b[2J": 1},
        "open": 0,
    }
    cases: list[tuple[Any, list[str]]] = [
        ([hostile.task_json(tid, attempt={})], ["list"]),
        ([hostile.task_json(tid, name=5)], ["list"]),
        ([summary], ["workflows"]),
    ]
    seen = []
    for answer, args in cases:

        async def handler(request: web.Request, answer: Any = answer) -> web.Response:
            return web.json_response(answer)

        async with hostile.api_server(handler) as url:
            code, _, err = await cli(bare_env(API_URL=url, API_TOKEN="t"), *args)
        seen.append((args, code, err[-300:]))
    for args, code, err in seen:
        assert code == 2, (args, err)
        assert "Traceback" not in err, (args, err)
        assert "unexpected body" in err, (args, err)


# -- Postgres that stops answering ------------------------------------------------------------


@contextmanager
def fake_postgres(after_startup: Callable[[socket.socket], None] | None) -> Iterator[int]:
    """A TCP server on 127.0.0.1 speaking just enough of Postgres's protocol: with
    `after_startup` None it accepts and never says anything; else it refuses SSL, lets the
    client in (trust), says it is ready, reads the query and calls `after_startup(conn)`."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []

    def exactly(conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            got = conn.recv(n - len(data))
            if not got:
                raise EOFError
            data += got
        return data

    def one(conn: socket.socket) -> None:
        try:
            while True:  # SSLRequest / GSSENCRequest first, then the startup message
                (size,) = struct.unpack("!i", exactly(conn, 4))
                body = exactly(conn, size - 4)
                if struct.unpack("!i", body[:4])[0] in (80877103, 80877104):
                    conn.sendall(b"N")
                    continue
                break
            version = b"server_version\x0016.0\x00"
            conn.sendall(
                b"R"
                + struct.pack("!ii", 8, 0)
                + b"S"
                + struct.pack("!i", 4 + len(version))
                + version
                + b"K"
                + struct.pack("!iii", 12, 1, 2)
                + b"Z"
                + struct.pack("!i", 5)
                + b"I"
            )
            conn.recv(65536)
            assert after_startup is not None
            after_startup(conn)
        except (OSError, EOFError):
            pass

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            if after_startup is not None:
                threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for conn in held:
            conn.close()


async def test_sked_status_gives_up_on_a_postgres_that_does_not_answer() -> None:
    """`sked status ID` against a Postgres that accepts the connection and says nothing (a
    frozen server, a half-open path, a stuck proxy) never returns: still running after 75 s,
    while `sked list` on the same server gives up after asyncpg's 60 s connect timeout.

    Why: shared/store/libpq.py fetch_text calls PQconnectdbParams with no connect_timeout
    (libpq's default is to wait forever) and PQexecParams with no bound; the asyncpg fallback
    (quick.read_task) is never reached, since libpq never fails.

    Now libpq connects within CONNECT_TIMEOUT_S (unless the URL says otherwise) and the
    query is waited for within QUERY_TIMEOUT_S (PQsendQueryParams, polled); the asyncpg
    fallback is bounded the same way, and the message says what timed out."""
    with fake_postgres(None) as port:
        env = bare_env(DATABASE_URL=f"postgresql://postgres@127.0.0.1:{port}/sked")
        started = time.monotonic()
        code, _, err = await cli(env, "status", str(uuid4()), limit=75)
    assert code is not None, f"sked status still waiting after {time.monotonic() - started:.0f} s"
    assert code == 2, err
    assert "timed out" in err, err


async def test_sked_status_says_the_connection_was_lost_when_postgres_drops_it() -> None:
    """`sked status ID` through libpq, when Postgres (or a proxy, or a restart) closes the
    connection mid-query, prints "sked: Postgres: unknown error" — as if Postgres had refused
    the query with no reason — where `sked list` (asyncpg) on the same server says "connection
    was closed in the middle of operation".

    Why: shared/store/libpq.py fetch_text takes the message only from
    PQresultErrorField(result, PG_DIAG_MESSAGE_PRIMARY), which libpq leaves NULL for errors it
    detects itself (a lost connection, a protocol error); `_message(None)` is "unknown error".

    Now libpq's own error is said as such: "lost the connection to Postgres: ..."."""
    with fake_postgres(lambda conn: conn.close()) as port:
        env = bare_env(DATABASE_URL=f"postgresql://postgres@127.0.0.1:{port}/sked")
        code, _, err = await cli(env, "status", str(uuid4()), limit=30)
    assert code == 2, err
    assert "unknown error" not in err, err


# -- the database URL as `sked status` reads it -----------------------------------------------


async def test_a_malformed_database_url_is_one_line_from_sked_status() -> None:
    """With SKED_DATABASE_URL malformed — a port that is no number, an unclosed IPv6 bracket,
    another scheme, an `sslmode` no client knows, a byte that is not UTF-8 — `sked status ID`
    prints a Python traceback (ValueError, ClientConfigurationError, UnicodeEncodeError),
    where `sked list` on the same URL says "sked: invalid settings: SKED_DATABASE_URL: ..."
    in one line. (`sslmode=bogus` and the non-UTF-8 byte are tracebacks from `sked list` too.)

    Why: `sked status` reads the URL with shared.settings.quick, skipping the settings model's
    validation (services/cli/remote.straight_to_postgres); libpq.fetch_text's `dsn.encode()`
    raises UnicodeEncodeError, and once libpq refuses the URL (NotConnected) the asyncpg
    fallback (db.pinned_dsn / asyncpg.connect) raises ValueError or asyncpg's
    ClientConfigurationError (an InterfaceError, not a PostgresError, so main's
    _postgres_said does not word it). Settings' own URL check does not look at sslmode.

    Now `sked status` checks the settings before its asyncpg fallback (a URL that is not
    UTF-8 is refused there too), libpq's path refuses such a URL as NotConnected, and main
    says asyncpg's ClientConfigurationError in one line."""
    seen = []
    for url in (
        "postgresql://postgres:s3cr3t@127.0.0.1:abc/sked",
        "postgresql://postgres:s3cr3t@[::1/sked",
        "mysql://postgres:s3cr3t@127.0.0.1/sked",
        "postgresql://postgres:s3cr3t@127.0.0.1/sked?sslmode=bogus",
        "postgresql://postgres@127.0.0.1/sked\udcff",  # the byte 0xff, as Python reads it
    ):
        code, _, err = await cli(bare_env(DATABASE_URL=url), "status", str(uuid4()), limit=30)
        seen.append((url, code, err.strip().splitlines()[-1:] if err else err))
        assert "s3cr3t" not in err
        if code != 2 or "Traceback" in err:
            continue
        seen.pop()
    assert seen == [], seen
