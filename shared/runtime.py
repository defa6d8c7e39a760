"""Running a service process: logging, uvloop, signals to stop(), and interruptible waits."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast

from shared import metrics, telemetry
from shared.errors import SkedError
from shared.redact import masked, printable
from shared.settings import Settings

log = logging.getLogger(__name__)


class Service(Protocol):
    ready: asyncio.Event  # set once it serves (shared.service.Service)

    async def run(self) -> None: ...
    def stop(self) -> None: ...


class _TextFormatter(logging.Formatter):
    """Readable lines that input cannot forge: the message (what may hold a task's name, a
    request's path, a producer's key) written inert, one line; and no URL's password in the
    line or its traceback."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        return masked(super().format(record))


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return masked(self._line(record))  # JSON escapes line breaks; passwords it keeps

    def _line(self, record: logging.LogRecord) -> str:
        line = {
            "at": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("task_id", "attempt", "trace_id", "service"):
            if hasattr(record, key):
                line[key] = str(getattr(record, key))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(settings: Settings, service: str) -> None:
    """The only place that installs log handlers: readable lines, or JSON with SKED_LOG_JSON."""
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_json:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(
            _TextFormatter(f"%(asctime)s %(levelname)-5s {service} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    for noisy in ("aiormq", "aio_pika"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


async def wait_any(*events: asyncio.Event, timeout: float | None = None) -> bool:
    """Return as soon as any of `events` is set (True), or after `timeout` seconds (False)."""
    if any(e.is_set() for e in events):
        return True
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    return bool(done)


async def first_done(*futures: asyncio.Future[Any]) -> None:
    """Return once any of `futures` is done; none of them is cancelled, here or when the
    caller is. What asyncio.wait(..., FIRST_COMPLETED) does for futures, without its sets,
    its per-call waiter bookkeeping and its copies: ~half its CPU, on a path every handler
    attempt takes (services/executor/backends/local)."""
    if any(f.done() for f in futures):
        return
    waiter = asyncio.get_running_loop().create_future()

    def wake(_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for future in futures:
        future.add_done_callback(wake)
    try:
        await waiter
    finally:
        for future in futures:
            future.remove_done_callback(wake)


T = TypeVar("T")
U = TypeVar("U")


async def both(first: Awaitable[T], second: Awaitable[U]) -> tuple[T, U]:
    """Await two at once (two round trips in the time of one). An error of either is raised
    once both are done, so neither is left running nor its own error unretrieved."""
    a, b = await asyncio.gather(first, second, return_exceptions=True)
    for result in (a, b):
        if isinstance(result, BaseException):
            raise result
    return cast(T, a), cast(U, b)


async def next_batch(
    inbox: asyncio.Queue[T | None],
    limit: int = 10_000,
    linger: float = 0.0,
    settle: Callable[[float], Awaitable[object]] | None = None,
) -> list[T] | None:
    """Wait for one item, then take whatever else is queued (up to `limit`).

    This is how sked's loops batch: under load the queue fills while the previous batch is
    written, so batches grow exactly when they help. `linger` (seconds) waits that much longer
    after the first item, for paths where a few milliseconds cost nothing a user sees but a
    statement per item would cost Postgres; `settle(linger)`, if given, is awaited instead of
    sleeping (a caller that knows when no more can come ends the wait early). None in the queue
    means stop: it returns None (leaving the None for the next call) once the items before it
    are taken.
    """
    first = await inbox.get()
    if first is None:
        inbox.put_nowait(None)
        return None
    if linger > 0 and inbox.qsize() < limit:
        await (asyncio.sleep(linger) if settle is None else settle(linger))
    batch = [first]
    while len(batch) < limit and not inbox.empty():
        item = inbox.get_nowait()
        if item is None:
            inbox.put_nowait(None)
            break
        batch.append(item)
    return batch


async def serve(service: Service) -> None:
    """Run `service` until it returns; SIGTERM and SIGINT ask it to stop. Once it is ready,
    what it built to start is frozen out of the garbage collector's way (`settle_memory`)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    settling = asyncio.create_task(_settle_when_ready(service))
    try:
        await service.run()
    finally:
        settling.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _settle_when_ready(service: Service) -> None:
    await service.ready.wait()
    settle_memory()


# Container objects allocated (net of those freed) between young collections, where Python's
# default is 700. A task's life in a service allocates hundreds of objects that live for its
# milliseconds in flight (messages, futures, rows, moves); at 700 the young collections walked
# them again and again and promoted them to be walked again: 4.6 % of the services' CPU in a
# burst of 8,000 tasks, 31-41 µs a task. At 10,000 most of them are gone by the next
# collection (0.6-1.3 % at 5,000-20,000); cyclic garbage then waits a little longer for its
# collection, a few MB at most (docs/performance.md, the sixteenth session).
GC_YOUNG = 10_000


def settle_memory() -> None:
    """Collect once, then move every object left (the modules, the settings, the clients and
    their pools: what a service builds to start and keeps) out of the cyclic collector's
    generations for good (gc.freeze). A full collection otherwise walked them all, ~65,000
    objects, each time: 60-160 ms during which the service served nothing, two to five times
    in a burst of 10,000 tasks (docs/performance.md). Only objects made after this are
    collected as before, the young ones less often (GC_YOUNG); a service process calls it
    once, when it is ready."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])


def run_main(main: Callable[[], Awaitable[None]]) -> int:
    """Run a service's async main on uvloop when available; the exit code says how it ended."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every platform we ship
        runner: Callable[[Awaitable[None]], None] = asyncio.run  # type: ignore[assignment]
    else:
        runner = uvloop.run  # type: ignore[assignment]
    with contextlib.suppress(KeyboardInterrupt):
        try:
            runner(main())
        except SkedError as exc:  # raised on purpose: its message says all (not migrated, ...)
            log.error("service failed: %s", exc)
            log.debug("service failed", exc_info=True)
            return 1
        except Exception:
            log.exception("service failed")
            return 1
    return 0


def service_args(service: str, description: str) -> argparse.ArgumentParser:
    """A service's argument parser: `--help` prints its usage and starts nothing. Its flags,
    if any, override SKED_* variables (see `flag_settings`)."""
    return argparse.ArgumentParser(
        prog=f"sked service {service}",
        description=f"{description} Configured by SKED_* environment variables (README); "
        "flags override them.",
    )


def flag_settings(args: argparse.Namespace, fields: dict[str, str], **extra: object) -> Settings:
    """Settings from SKED_* variables, each flag given (`fields`: flag dest -> settings field)
    overriding its variable; `extra` are further overrides."""
    overrides = {field: getattr(args, dest) for dest, field in fields.items()}
    given = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**given, **extra)


PR_SET_DUMPABLE = 4


def keep_private() -> None:
    """Close this process to the other processes of its user — the tasks an executor runs are
    among them: its /proc entries (its environment holds the database URL and the heartbeat
    secret) become root's, and ptrace is refused (prctl PR_SET_DUMPABLE 0; no core dump, which
    would hold the same). Root still reads them. An exec (the warden, a handler worker) is
    dumpable again, and holds no secret. Linux only; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")
    except (OSError, AttributeError) as exc:
        log.warning("cannot close this process to its user's other processes: %s", exc)


def open_files_to_the_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit: a service holds a
    connection per client (the heartbeat endpoint one per task process beating), and the
    usual soft limit of 1,024 is what a single task opening connections would exhaust."""
    try:
        import resource
    except ImportError:  # not on every platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_service(
    service: str,
    settings: Settings,
    main: Callable[[Settings], Awaitable[None]],
    log_as: str | None = None,
    *,
    signs_heartbeats: bool = False,
) -> int:
    """A service process from start to exit code: its log lines (named `log_as`, default the
    service), its traces as sked-<service>, then `main(settings)` on uvloop. A service that
    signs or checks heartbeat tokens refuses to start without a real secret (exit 2). Its
    metrics, with SKED_METRICS_PORT set, on GET /metrics."""
    if signs_heartbeats:
        try:
            settings.require_heartbeat_secret()
        except ValueError as exc:
            print(f"sked service {service}: {exc}", file=sys.stderr)  # noqa: T201
            return 2
    keep_private()
    open_files_to_the_limit()
    from shared.store.db import named_dsn, pinned_dsn  # asyncpg: a service's, not the CLI's

    # every session of this process shows as sked-<service> in pg_stat_activity, and works in
    # sked's schema whatever the role's default search_path finds first
    dsn = pinned_dsn(named_dsn(settings.database_url, f"sked-{service}"))
    settings = settings.model_copy(update={"database_url": dsn})
    configure_logging(settings, log_as or service)
    telemetry.setup(f"sked-{service}")
    metrics.setup(settings, service)
    return run_main(lambda: main(settings))
