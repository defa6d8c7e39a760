"""A scheduler and one local executor running in the test's own process, for tests that
watch what happens inside them (installed hooks, exported spans): `pipeline` yields the
scheduler's store and a client (`services`: the services too), and stops both services at the
end, bounded."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.executor.backends.local import LocalBackend
from services.executor.service import Executor
from services.scheduler.service import Scheduler
from shared.client import SkedClient
from shared.settings import Settings
from shared.store import Store
from shared.wiring import backends


@dataclass
class Services:
    store: Store  # the scheduler's
    client: SkedClient
    scheduler: Scheduler
    executor: Executor


@contextlib.asynccontextmanager
async def services(
    settings: Settings,
    tmp_path: Path,
    node_id: str = "inproc",
    scheduler_settings: Settings | None = None,
    slots: int = 1,
    **node: Any,
) -> AsyncIterator[Services]:
    """The scheduler and the executor of node `node_id` (`slots`, and any other settings of
    its own in `node`), running."""
    node_settings = settings.model_copy(update={"node_id": node_id, "slots": slots, **node})
    scheduler_settings = scheduler_settings or settings  # its servers' addresses too
    async with backends(scheduler_settings) as s, backends(node_settings) as e:
        scheduler = Scheduler(scheduler_settings, s.store, s.bus, s.ready_queue)
        backend = LocalBackend(slots, tmp_path)
        executor = Executor(node_settings, e.store, e.bus, backend, e.ready_queue)
        running = [asyncio.create_task(scheduler.run()), asyncio.create_task(executor.run())]
        try:
            await asyncio.wait_for(scheduler.ready.wait(), 30)
            await asyncio.wait_for(executor.ready.wait(), 30)
            async with SkedClient(settings) as client:
                yield Services(s.store, client, scheduler, executor)
        finally:
            scheduler.stop()
            executor.stop()
            done, pending = await asyncio.wait(running, timeout=30)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()  # a service's own failure fails the test
            assert not pending, "a service did not stop within 30 s"


@contextlib.asynccontextmanager
async def pipeline(
    settings: Settings,
    tmp_path: Path,
    node_id: str = "inproc",
    scheduler_settings: Settings | None = None,
) -> AsyncIterator[tuple[Store, SkedClient]]:
    async with services(settings, tmp_path, node_id, scheduler_settings) as running:
        yield running.store, running.client
