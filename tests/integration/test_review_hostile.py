"""An adversarial review of the SDK, startup, policy and hooks code the session of 2026-12-07
changed: seven defects of that code, each mended (the docstrings say how)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from aiohttp import web

from shared import hooks, queues
from shared.api_client import ApiClient
from shared.client import WaitTimeout
from shared.errors import SkedError
from shared.models import CommandJob
from shared.policy import JobPolicy
from shared.wiring import _refused_by_redis
from tests.integration.test_client_hostile import TOKEN, api_server
from tests.integration.test_sdk_hostile import finished, script
from tests.integration.test_startup_hostile import silent_port  # noqa: F401 - fixture

# -- SyncSkedClient ----------------------------------------------------------------------------


async def test_sync_close_from_a_signal_handler_during_a_call_does_not_deadlock(
    service_env: dict[str, str],
) -> None:
    """A script waits with SyncSkedClient and installs the usual shutdown handler,
    `signal.signal(SIGTERM, lambda *_: sked.close())` (here SIGALRM after 1 s). The handler
    runs on the thread whose call holds the client's lock. close() should end the call (as it
    does from another thread: SkedError 'the client is closed') or at least return, and the
    script exit. close() scheduled the cancel, then blocked on the lock its own thread held:
    the process hung for ever. Now close() from within a call on its own thread only cancels
    it, and the call shuts the client as it unwinds."""
    proc = script(
        service_env,
        """
        import signal, uuid
        from shared.sync_client import SyncSkedClient
        sked = SyncSkedClient()
        sked.tasks(limit=1)
        signal.signal(signal.SIGALRM, lambda *_: sked.close())
        signal.alarm(1)
        try:
            sked.wait(uuid.uuid4(), timeout=4)  # ends by itself in 4 s unless wedged
        except Exception as exc:
            print("ended", type(exc).__name__, flush=True)
        """,
    )
    done = await finished(proc, 12)
    assert done is not None, "close() from a signal handler during a call hung the process"
    out, err = done
    assert "ended SkedError" in out, (out, err[-2000:])


# -- ApiClient -----------------------------------------------------------------------------------


async def test_api_wait_all_reports_a_permanent_error_instead_of_polling_for_ever() -> None:
    """`sked wait` / ApiClient.wait_all with no timeout against an API URL that can never
    work: https:// to a server that speaks plain HTTP (the TLS handshake fails the same way
    every time; an untrusted certificate or a mistyped scheme does too). Before this session
    the error came back at once ('the API at ... did not answer: ...'). Now every aiohttp
    ClientError (SSL, invalid URL, non-HTTP scheme included) was ApiUnavailable, polled
    through silently. Now only a connection refused, reset or timed out (and 502/503/504)
    is; TLS and URL errors are said at once."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": "never reached"}, status=500)

    async with api_server(handler) as url:
        api = ApiClient(url.replace("http://", "https://"), TOKEN, timeout=2)
        try:
            got: BaseException | None = None
            try:
                await asyncio.wait_for(api.wait_all([uuid4()], timeout=None), 8)
            except TimeoutError:
                got = None  # the wait was still polling after 8 s
            except Exception as exc:
                got = exc
        finally:
            await api.close()
    assert got is not None, "wait_all polled a TLS failure silently for 8 s (no timeout: forever)"
    assert isinstance(got, SkedError), repr(got)
    assert not isinstance(got, WaitTimeout), repr(got)


# -- startup: Redis -------------------------------------------------------------------------------


async def test_a_silent_redis_at_start_is_ridden_out_as_the_docstring_says(
    silent_port: int,  # noqa: F811 - the fixture
) -> None:
    """A service starts while its Redis accepts connections but does not answer (a Redis
    hung on a fork, a frozen VM). wiring._refused_by_redis's contract: 'Redis down or silent
    is an outage the services ride out (shared/degrade.py), so only a refusal stops the
    start'. redis-py's own timeout (queues.connect sets socket_timeout, shorter than
    CONNECT_S) raises redis.exceptions.TimeoutError, a RedisError but neither RedisDown nor
    the builtin TimeoutError, so it fell into `except RedisError` and the service exited 1.
    Now redis-py's TimeoutError is ridden out too."""
    url = f"redis://127.0.0.1:{silent_port}/0"
    redis = queues.connect(url)
    try:
        outcome: BaseException | None = None
        try:
            await asyncio.wait_for(_refused_by_redis(redis, url), 20)
        except BaseException as exc:  # what the start would see
            outcome = exc
    finally:
        with contextlib.suppress(Exception):
            await redis.aclose()
    assert outcome is None, f"a silent Redis stopped the start: {outcome!r}"


# -- hooks: an observer's failure is its own -------------------------------------------------------


class _ShortHeaders(hooks.Hook):
    """An exporter with a bug: headers for none of the tasks it was given."""

    def dispatching(self, tasks: Sequence[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
        return [], []


class _ExtraContexts(hooks.Hook):
    """An exporter with a bug: one trace context more than there are submissions."""

    def received(
        self, queue: str, task_ids: Sequence[Any], parents: Sequence[str | None]
    ) -> tuple[list[str | None], list[Any]]:
        return [*parents, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"], []


@pytest.fixture
def isolated_hooks() -> Iterator[list[hooks.Hook]]:
    saved = list(hooks.installed)
    hooks.installed.clear()
    try:
        yield hooks.installed
    finally:
        hooks.installed[:] = saved


def test_a_hook_giving_the_wrong_number_of_headers_does_not_fail_the_dispatch(
    isolated_hooks: list[hooks.Hook],
) -> None:
    """An installed observer's `dispatching` returns headers for fewer tasks than it was
    given (a bug in an exporter). hooks.py promises 'an observer's failure is its own': the
    dispatch should go out with the other hooks' headers ({} here). _guarded only catches an
    exception inside the hook's call; the seam then zips the hook's answer with strict=True
    (hooks.py dispatching) and raises ValueError itself. In scheduler/sending.py send() that is
    after COMMIT and before the take-back's try: the tasks sat in Scheduling with no message
    sent. Now an answer of another shape is the hook's failure (hooks._answer), ignored."""
    isolated_hooks.append(_ShortHeaders())
    headers, _ = hooks.dispatching([object(), object()])  # type: ignore[list-item]
    assert headers == [{}, {}]


def test_a_hook_giving_the_wrong_number_of_trace_contexts_is_ignored(
    isolated_hooks: list[hooks.Hook],
) -> None:
    """An installed observer's `received` returns one trace context more than there are
    submissions (a bug in an exporter). hooks.py promises 'an observer's failure is its own':
    the seam should keep the parents' contexts (one per task), as it does when the hook
    raises. It takes the hook's answer unchecked (hooks.py received: `contexts, more =
    theirs`). Checked against the store: Tasks.admit_many with 3 traceparents for 2 specs
    raises NotNullViolationError (unnest pads the ids with NULL), not transient, so intake's
    isolate() splits down to each submission alone, fails again, and dead-letters every one
    ('cannot be admitted'): a broken observer sent every submitted task to sked.dead. Now
    an answer of another shape is ignored (hooks._answer)."""
    isolated_hooks.append(_ExtraContexts())
    ids = [uuid4(), uuid4()]
    contexts, _ = hooks.received("sked.submit", ids, ["00-a-b-01", None])
    assert contexts == ["00-a-b-01", None]


# -- policy -------------------------------------------------------------------------------------


def test_git_external_diff_is_refused_under_a_command_allowlist(tmp_path: Path) -> None:
    """SKED_ALLOWED_COMMANDS=/usr/bin/git and a job `git diff --no-index a b` with
    GIT_EXTERNAL_DIFF='touch pwned #' in its own env. git runs GIT_EXTERNAL_DIFF through
    the shell (checked below: the marker file appears), so the job runs any code it likes
    while the allowlist names only git. The policy lists git's GIT_SSH_COMMAND, GIT_EXEC_PATH
    and GIT_CONFIG* (so it means to cover git) but not GIT_EXTERNAL_DIFF (nor GIT_SSH,
    GIT_PROXY_COMMAND, GIT_ASKPASS, GIT_EDITOR, GIT_PAGER). The job should be refused,
    naming the variable; now it is, with those, editors', pagers' and askpass ones."""
    git = "/usr/bin/git"
    marker = tmp_path / "pwned"
    env = {"GIT_EXTERNAL_DIFF": f"touch {marker} #"}
    argv = [git, "diff", "--no-index", "a", "b"]
    if os.path.exists(git):  # the premise, shown where git is installed (the refusal is not)
        (tmp_path / "a").write_text("a\n")
        (tmp_path / "b").write_text("b\n")
        subprocess.run(
            argv,
            env={"PATH": "/usr/bin:/bin", **env},
            cwd=tmp_path,
            capture_output=True,
            timeout=10,
        )
        assert marker.exists(), "the premise: git ran GIT_EXTERNAL_DIFF's command"
    policy = JobPolicy.of([], [git])
    assert policy.refuses(CommandJob(argv=argv, env=env)) is not None


# -- startup: Postgres ----------------------------------------------------------------------------


async def test_a_service_started_against_a_missing_database_is_told_to_run_sked_migrate(
    settings: Any,
) -> None:
    """A service starts with SKED_DATABASE_URL naming a database not created yet (compose
    starts services beside `sked migrate`). connect_store's own contract (wiring.py: `except
    asyncpg.InvalidCatalogNameError` -> 'Postgres: ...: run `sked migrate` (it creates it)')
    is to name the fix. The new `starting` wrapper around the connect turns the same error into
    'Postgres at host:port: database "..." does not exist' first, so the hint was gone.
    Now `starting` lets that error through to connect_store."""
    from urllib.parse import urlsplit, urlunsplit

    from shared.wiring import connect_store

    parts = urlsplit(settings.database_url)
    missing = urlunsplit(parts._replace(path=f"/probe_missing_{uuid4().hex[:12]}"))
    with pytest.raises(SkedError) as caught:
        await connect_store(settings.model_copy(update={"database_url": missing}))
    assert "sked migrate" in str(caught.value), str(caught.value)
