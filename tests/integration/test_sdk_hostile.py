"""The synchronous SDK (shared/sync_client.py) and the operator-API client
(shared/api_client.py, as the CLI uses it) against forks, interrupts, threads, event loops and
an API that misbehaves."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from uuid import UUID, uuid4

import pytest
from aiohttp import web

from shared import fsm
from shared.api_client import ApiClient
from shared.client import SkedClient
from shared.errors import SkedError
from shared.fsm import State
from shared.settings import Settings
from shared.store import Store
from tests.helpers import spec
from tests.integration.test_client_hostile import TOKEN, api_server, task_json

ROOT = Path(__file__).resolve().parents[2]


def script(env: dict[str, str], code: str) -> subprocess.Popen[str]:
    """`python -c CODE` with this test's deployment in its environment, and SIGINT's default
    action (a test run in the background inherits SIGINT ignored, and so would the script:
    Python then installs no KeyboardInterrupt for it, and Ctrl-C would do nothing)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


async def finished(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str] | None:
    """Its stdout and stderr once it exits, or None (and it is killed) if it outlives
    `timeout`."""
    try:
        return await asyncio.to_thread(proc.communicate, None, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None


# -- the synchronous SDK -----------------------------------------------------------------------


async def test_forked_child_closing_its_inherited_client_does_not_wedge_the_parent(
    service_env: dict[str, str],
) -> None:
    """A SyncSkedClient made (and connected) before os.fork(); the child closes it (a
    `with` block or a cleanup handler in a forked worker, the default multiprocessing start
    method on Linux) and exits. The parent's next call must still answer (or raise a clear
    SkedError) in bounded time. The child's close() terminated the Postgres connections it
    shares with the parent and unregistered their sockets from the epoll instance it also
    shares, so the parent's next `sked.tasks()` waited forever. Now a client knows the
    process it was made in: a child's calls are refused and its close() touches nothing."""
    proc = script(
        service_env,
        """
        import os
        from shared.sync_client import SyncSkedClient
        sked = SyncSkedClient()
        sked.tasks(limit=1)
        pid = os.fork()
        if pid == 0:
            sked.close()
            os._exit(0)
        os.waitpid(pid, 0)
        print("child done", flush=True)
        try:
            print("parent listed", len(sked.tasks(limit=1)), flush=True)
        except Exception as exc:
            print("parent refused", type(exc).__name__, exc, flush=True)
        sked.close()
        """,
    )
    done = await finished(proc, 15)
    assert done is not None, "the parent's call after its forked child closed the client hung"
    out, err = done
    assert "parent listed 0" in out or "parent refused SkedError" in out, (out, err[-2000:])


async def test_ctrl_c_during_a_sync_wait_exits_without_tracebacks(
    service_env: dict[str, str],
) -> None:
    """A script waits with SyncSkedClient (`with SyncSkedClient() as sked: sked.wait(id)`)
    and the user presses Ctrl-C; the script catches KeyboardInterrupt. Leaving the `with`
    should stop the wait and close everything quietly. run_until_complete was interrupted
    with the wait's task (and its LISTEN task) still pending; close() closed the loop under
    them, and stderr filled with 'Event loop is closed' tracebacks and 'Task was destroyed but
    it is pending!'. Now each call runs on an asyncio.Runner: Ctrl-C cancels it, and close()
    cancels and drains what is left."""
    proc = script(
        service_env,
        """
        import uuid
        from shared.sync_client import SyncSkedClient
        try:
            with SyncSkedClient() as sked:
                sked.tasks(limit=1)
                print("waiting", flush=True)
                sked.wait(uuid.uuid4())
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 15)
    assert line == "waiting\n", line
    await asyncio.sleep(1.0)  # the wait is listening
    proc.send_signal(signal.SIGINT)
    done = await finished(proc, 10)
    assert done is not None, "the script hung after Ctrl-C"
    out, err = done
    assert "interrupted" in out, (out, err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    assert "Task was destroyed" not in err, err[-3000:]


async def test_close_from_another_thread_ends_a_running_wait(settings: Settings) -> None:
    """Thread A waits (here 8 s; as well forever) for a task; thread B calls close() to stop
    it (shutting a worker down). close() should return promptly and A's wait end with
    SkedError ('the client is closed'). close() took the lock the wait held for its whole
    run, so it blocked until the wait ended (with no timeout, never). Now close() first
    cancels the call in progress, from its thread."""
    from shared.sync_client import SyncSkedClient

    sked = SyncSkedClient(settings)
    errors: list[BaseException] = []

    def waits() -> None:
        try:
            sked.wait(uuid4(), timeout=8)
        except BaseException as exc:
            errors.append(exc)

    def run() -> tuple[bool, bool]:
        sked.tasks(limit=1)
        waiter = threading.Thread(target=waits, daemon=True)
        waiter.start()
        time.sleep(0.5)
        closer = threading.Thread(target=sked.close, daemon=True)
        closer.start()
        closer.join(5)
        blocked = closer.is_alive()
        waiter.join(5)
        closer.join(5)  # bounded: the wait's own timeout lets it go
        return blocked, waiter.is_alive()

    closing, waiting = await asyncio.to_thread(run)
    assert not closing, "close() from another thread was still blocked after 5 s"
    assert not waiting, errors
    assert len(errors) == 1, errors
    assert isinstance(errors[0], SkedError), errors


async def test_sync_client_called_inside_a_running_loop_is_a_sked_error(
    settings: Settings,
) -> None:
    """SyncSkedClient called from async code (a running event loop in this thread): it
    should refuse with a SkedError saying to use SkedClient (as it refuses a closed client,
    closing the coroutine it was given). It raised a bare RuntimeError ('Cannot run the
    event loop while another loop is running') and dropped the call's coroutine un-awaited.
    Now it is a SkedError naming SkedClient, the coroutine closed."""
    from shared.sync_client import SyncSkedClient

    sked = SyncSkedClient(settings)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(SkedError):
                sked.tasks(limit=1)
            import gc

            gc.collect()
        assert not [w for w in seen if "never awaited" in str(w.message)], seen
    finally:
        await asyncio.to_thread(sked.close)


# -- the operator-API client -------------------------------------------------------------------


async def test_api_wait_rides_out_one_503() -> None:
    """wait(id, timeout=10) through the API (`sked submit --wait`, `sked wait`), while the API
    answers one poll with 503 'a backend is unavailable; retry' (its OpenAPI says 503 means
    retry; a rolling restart of the API's two replicas does the same). SkedClient's wait rides
    out Postgres being away (TRANSIENT: look again); the API client's must too and return the
    task when it ends. ApiClient.wait_all re-raised any SkedError before the deadline, so
    `sked submit --wait` exited 2 though the task was accepted and finished fine. Now 502,
    503, 504 and no answer at all are ApiUnavailable, which a wait polls on through."""
    asked = 0

    async def handler(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        if asked == 2:
            return web.json_response({"error": "a backend is unavailable; retry"}, status=503)
        status = "success" if asked >= 4 else "running"
        return web.json_response(task_json(UUID(request.path.rsplit("/", 1)[-1]), status=status))

    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        task = await asyncio.wait_for(client.wait(uuid4(), timeout=10), 15)
    assert task.status is State.SUCCESS


@pytest.mark.parametrize("timeout", [0, -1])
async def test_api_wait_without_time_left_still_reads_a_finished_task(
    settings: Settings, store: Store, timeout: float
) -> None:
    """A task that has already ended, waited for with timeout 0 (or less): SkedClient looks
    once and returns it (shown here). ApiClient ("the same names, arguments and return
    types") must too. Its wait_all checked the deadline before the first GET, never asked,
    and raised WaitTimeout for a task that was Canceled. Now a wait with no time left has one
    round of asking (FIRST_LOOK_S)."""
    (task,) = await store.tasks.create_many([spec(name="ended")])
    ended = await fsm.apply(store.tasks, task, State.CANCELED)
    async with SkedClient(settings) as direct:
        assert (await direct.wait(task.id, timeout=timeout)).status is State.CANCELED

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(task_json(ended.id, status="canceled"))

    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        got = await asyncio.wait_for(client.wait(task.id, timeout=timeout), 5)
    assert got.status is State.CANCELED


async def test_api_answer_about_another_task_is_refused() -> None:
    """GET /v1/tasks/A answered with task B (a misrouting proxy or cache, a hostile API):
    the client should refuse an answer that is not about the id it asked for. ApiClient.get
    returned task B as if it were A, so `sked status A` reported another task's status. Now
    the answer's id is checked."""
    other = uuid4()

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(task_json(other, status="success"))

    asked = uuid4()
    async with api_server(handler) as url, ApiClient(url, TOKEN) as client:
        try:
            task = await client.get(asked)
        except SkedError:
            return  # refused: right
    assert task.id == asked, f"asked for {asked}, was given {task.id} and took it"
