"""The one service skeleton: run / stop / ready, the LISTEN connection and the supervised loops
are written once here; a service declares what it has of them.

    class Relay(Service):
        name = "relay"
        async def loop(self): ...  # the one loop; or loops() for several
        def channels(self): return [(TASK_CHANNEL, self._notified)]

`run()` returns only after `stop()` (SIGTERM in a service process); loops restart after
transient errors (shared.resilience) and any other error stops the service with it;
`async with service:` runs it in the background for tests and `sked dev`. Modelled on
temporalio's Worker (run/shutdown) and procrastinate's supervised side tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any

from shared.resilience import supervise
from shared.settings import Settings
from shared.store import Handler, Store
from shared.store.notify import PgListener

log = logging.getLogger(__name__)

Loop = tuple[str, Callable[[], Coroutine[Any, Any, None]]]


class Service:
    name = "service"

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.stopping = asyncio.Event()
        self.wake = asyncio.Event()  # for a service's own loop: set by missed() unless overridden
        self.ready = asyncio.Event()  # set once running: tests and `sked dev` wait on it
        self.listener: PgListener | None = None  # its LISTEN connection, once running
        self._running: asyncio.Task[None] | None = None

    # -- what a service declares -------------------------------------------------------------

    def loops(self) -> Sequence[Loop]:
        """Loops run until stop(), each restarted after a transient error. By default the one
        `loop` of a service that has one."""
        return [(self.name, self.loop)]

    async def loop(self) -> None:
        """The loop of a service with one loop (see `loops`)."""

    def watchers(self) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        """Tasks that may only fail (a raise stops the service); cancelled at stop."""
        return []

    def channels(self) -> Sequence[tuple[str, Handler]]:
        """Postgres NOTIFY channels to LISTEN on, with their handlers."""
        return []

    def missed(self) -> None:
        """The LISTEN connection came back: notifications may have been missed meanwhile."""
        self.wake.set()

    async def setup(self) -> None:
        """Before the loops: open consumers, register, rebuild."""

    def announce(self) -> str | None:
        """The line logged once the service is ready (tests and operators wait for it)."""
        return None

    async def draining(self) -> None:
        """After stop(), before the loops are let go: finish what is in hand."""

    async def teardown(self) -> None:
        """Always, last: close what setup opened."""

    def on_stop(self) -> None:
        """Called by stop(), synchronously (e.g. to wake a loop blocked on a queue)."""

    # -- the skeleton ------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self.setup()
            async with asyncio.TaskGroup() as group:
                listener = None
                if self.channels():
                    listener = self.listener = self.store.listener(self.channels(), self.missed)
                    group.create_task(listener.run(self.stopping))
                for name, loop in self.loops():
                    group.create_task(supervise(name, loop, self.stopping))
                watching = [group.create_task(watch()) for watch in self.watchers()]
                if listener is not None:
                    await _first(listener.connected.wait(), self.stopping.wait())
                self.ready.set()
                line = self.announce()
                if line:
                    log.info("%s", line)
                await self.stopping.wait()
                await self.draining()
                for task in watching:
                    task.cancel()
        finally:
            await self.teardown()

    def stop(self) -> None:
        if not self.stopping.is_set():
            log.info("%s stopping", self.name)
        self.stopping.set()
        self.on_stop()

    async def __aenter__(self) -> Service:
        self._running = asyncio.create_task(self.run())
        await _first(self.ready.wait(), asyncio.shield(self._running))
        if self._running.done():
            self._running.result()  # it failed on the way up: say why
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if self._running is not None:
            await self._running


async def _first(*waits: Awaitable[object]) -> None:
    """Wait until the first of `waits` is done; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
