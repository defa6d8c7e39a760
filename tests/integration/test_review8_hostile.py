"""A review of the sixteenth session's later commits (review 8): the C environment put back
after each handler job (2e612f7), a bounded pool's bounded connects (c96e1da), the claim
window and the retiring worker's os._exit (fac314c). Each case failed on that code (the
docstrings say what happened, and what happens now). Held up: a normal job never takes the
slow path (0 full reads of the C environment in 200 jobs); a job that prints and retires
its worker keeps its log, and the three jobs queued behind it ran in a fresh worker.

Handlers run in the workers as `tests.integration.test_probe_review8:<name>`."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from uuid import uuid4

from services.executor.backends import Launch
from services.executor.backends.local import LocalBackend
from shared.models import HandlerJob
from shared.settings import Settings
from shared.wiring import connect_store, node_statement_s
from tests.integration.test_worker_state_hostile import one, run  # noqa: F401 (one: a fixture)

HERE = "tests.integration.test_review8_hostile"
ROOT = Path(__file__).resolve().parents[2]


# --- handlers (run in the workers) -------------------------------------------------------------


def child_env() -> list[str]:
    """What a subprocess started with the worker's environment (env=None) gets."""
    out = subprocess.run(["/usr/bin/env"], capture_output=True, check=True, env=None).stdout
    return sorted(
        line
        for line in out.decode(errors="replace").splitlines()
        if line.startswith(("PROBE_", "PATH=", "HOME="))
    )


def putenv_names(names: list[str]) -> str:
    for name in names:
        os.putenv(name, "x")
    return "ok"


def clear_c_env() -> str:
    """A C library's clearenv() (as some sandboxing or daemonising code calls): environ = NULL,
    below os.environ."""
    ctypes.CDLL(None).clearenv()
    return "ok"


def leave_a_setenv_thread(seconds: float) -> int:
    """A job that sets a variable below os.environ and leaves a thread (a C library's own
    worker) setting and unsetting another there, for `seconds`."""
    libc = ctypes.CDLL(None)
    libc.setenv.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    libc.unsetenv.argtypes = [ctypes.c_char_p]
    deadline = time.monotonic() + seconds

    def body() -> None:
        while time.monotonic() < deadline:
            libc.setenv(b"PROBE_THREAD", b"1", 1)
            libc.unsetenv(b"PROBE_THREAD")

    threading.Thread(target=body, daemon=True).start()
    libc.setenv(b"PROBE_SET_BY_JOB", b"1", 1)
    return os.getpid()


def pid() -> int:
    return os.getpid()


# --- helpers -----------------------------------------------------------------------------------


def handler(name: str, args: Any = None, inputs: Any = None) -> Launch:
    job = HandlerJob(handler=f"{HERE}:{name}", args=args)
    return Launch(uuid4(), 1, job, None, inputs=inputs)


# --- findings ----------------------------------------------------------------------------------


async def test_a_variable_put_below_os_environ_by_a_job_with_one_more_variable_is_put_back(
    one: LocalBackend,
) -> None:
    """Job A (a handler that sets a variable with os.putenv, as a C library's setenv does) has
    one variable more in its job environment than the job before it (a workflow task's
    SKED_INPUTS, after a task without inputs). JobEnv.use's setenv grows the C array in place
    (the room an earlier job's variables left: unsetenv never shrinks it), so mark_env keeps
    the stale length (`where == _env_at` and the last mark ended in NULL) and marks one slot
    short: A's own variable lands past the mark, _c_env_back sees no change, and the next
    job's mark (re-counted then) takes it as the worker's. Every later job's subprocesses get
    A's variable (an LD_PRELOAD, say): the leak 2e612f7 exists to close, still open whenever
    the job environment's length changes. Now the mark is counted again whenever the slot
    at its count is no longer the array's NULL."""
    base = await run(one, handler("child_env"))
    assert base.ok, base.error
    # an earlier job that set (and had taken back) a few variables below os.environ: the C
    # library's array has room now (unsetenv never shrinks it)
    assert (await run(one, handler("putenv_names", [["PROBE_A1", "PROBE_A2", "PROBE_A3"]]))).ok
    assert (await run(one, handler("child_env"))).result == base.result
    # a job with one variable more than the last (a workflow task's SKED_INPUTS, say)
    a = await run(one, handler("putenv_names", [["PROBE_LEAK"]], inputs={"up": 1}))
    assert a.ok, a.error
    b = await run(one, handler("child_env"))
    assert b.ok, b.error
    assert b.result == base.result, "the next job's subprocess got what A set below os.environ"


async def test_clearenv_by_a_job_is_put_back(one: LocalBackend) -> None:
    """Job A calls the C library's clearenv() (daemonising or sandboxing code does): environ
    becomes NULL. _c_env_back returns at once when `where is None` (and mark_env drops the mark
    for the next job when so), so nothing is put back: os.environ still lists PATH and HOME,
    JobEnv.use sets only the job variables whose values change, and every later job's
    subprocess (env=None: exec passes the C environment) runs with no PATH, HOME, LANG, only
    SKED_TASK_ID. Now a NULL environ counts as changed, and is rebuilt from os.environ."""
    base = await run(one, handler("child_env"))
    assert base.ok, base.error
    a = await run(one, handler("clear_c_env"))
    assert a.ok, a.error
    b = await run(one, handler("child_env"))
    assert b.ok, b.error
    assert b.result == base.result, "the next job's subprocess got a cleared environment"


async def test_a_c_environment_changed_beside_a_thread_the_job_left_retires_the_worker(
    one: LocalBackend,
) -> None:
    """jobstate._c_environ walks the C library's environ array through ctypes with no lock,
    while another thread of the process may be inside setenv/unsetenv (ctypes and C
    extensions run them without the GIL): a realloc frees the array under the walk. A thread
    setting and unsetting 50 variables beside a reader calling _c_environ killed the reader
    with SIGSEGV at once; in a worker, a job that left such a thread could crash it in a later
    task's job. Now the entries are walked only while the worker is the process's one thread
    (/proc/self/task); with others alive, a changed C environment retires the worker."""
    a = await run(one, handler("leave_a_setenv_thread", [10.0]))
    assert a.ok, a.error
    b = await run(one, handler("child_env"))
    assert b.ok, b.error
    assert not [line for line in b.result if line.startswith("PROBE_")], b.result
    c = await run(one, handler("pid"))
    assert c.result != a.result, "the worker whose C environment a thread changes kept on"


class SlowFirstAnswer:
    """A TCP proxy to Postgres whose server side's first bytes on each connection come
    `delay` s late (a server under load forking a backend, slow authentication, TLS on a long
    link); everything after flows at once."""

    def __init__(self, target: int, delay: float) -> None:
        self.target, self.delay = target, delay
        self.port = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> SlowFirstAnswer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self.writers.append(up_w)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, delay: float) -> None:
            with contextlib.suppress(Exception):
                first = True
                while data := await r.read(65536):
                    if first and delay:
                        await asyncio.sleep(delay)
                    first = False
                    w.write(data)
                    await w.drain()
            with contextlib.suppress(Exception):
                w.close()

        await asyncio.gather(pump(reader, up_w, 0), pump(up_r, writer, self.delay))

    async def close(self) -> None:
        for w in self.writers:
            with contextlib.suppress(Exception):
                w.transport.abort()
        if self.server is not None:
            self.server.close()


async def test_an_executor_starts_on_a_postgres_whose_connects_are_slow_but_healthy(
    settings: Settings,
) -> None:
    """The executor's pool bounds each statement at half the node TTL (node_statement_s) and,
    since c96e1da, each connect at the same. A Postgres whose connects are slow but healthy
    (here: its first answer 3 s late, as a loaded server forking backends, slow
    authentication, or TLS over a long link give; SELECT 1 then takes no time) with a node TTL
    of 4 s (bound 2 s) now fails the executor's start: connect_store's `starting` turns the
    pool's TimeoutError into SkedError "did not answer within 10 s" (wrong too: it gave up at
    2 s) and the process exits 1, and does so on every restart: the node never starts. Before,
    the connect took 3 s and the start succeeded (checked with statement_s=59). After start the
    same bound makes every fresh connection fail for good (retried, never succeeding). A
    connect has several round trips (TCP, SSL request, startup, SCRAM's two) where a statement
    has one. Now a connect's bound is the statement bound but never below db.CONNECT_S
    (10 s, as long as a service's start waits)."""
    url = urlsplit(settings.database_url)
    proxy = await SlowFirstAnswer(url.port or 5432, 3.0).start()
    node = settings.model_copy(
        update={
            "node_ttl_s": 4.0,
            "node_heartbeat_s": 1.0,
            "database_url": settings.database_url.replace(
                f"{url.hostname}:{url.port}", f"127.0.0.1:{proxy.port}"
            ),
        }
    )
    try:
        async with asyncio.timeout(40):
            store = await connect_store(node, statement_s=node_statement_s(node))
            try:
                assert await store.pool.fetchval("SELECT 1") == 1
            finally:
                await store.close()
    finally:
        await proxy.close()
