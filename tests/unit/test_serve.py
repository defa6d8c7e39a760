"""A service process settles its memory once it is ready: what it built to start is frozen out
of the cyclic garbage collector's full collections (shared.runtime.serve)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from shared import runtime
from shared.runtime import serve


class Toy:
    """A service as serve() sees it: run(), stop(), and the ready event shared.service has."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.stopping = asyncio.Event()
        self.frozen_at_ready: int | None = None

    async def run(self) -> None:
        self.frozen_at_ready = gc.get_freeze_count()
        self.ready.set()
        await self.stopping.wait()

    def stop(self) -> None:
        self.stopping.set()


async def test_what_a_service_built_to_start_is_frozen_once_it_is_ready_and_young_collections_thin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gc.unfreeze()
    threshold = gc.get_threshold()
    settled = asyncio.Event()

    def settle_memory() -> None:
        real_settle()
        settled.set()

    real_settle = runtime.settle_memory
    monkeypatch.setattr(runtime, "settle_memory", settle_memory)
    toy = Toy()
    serving = asyncio.create_task(serve(toy))
    try:
        await asyncio.wait_for(settled.wait(), 10)
        assert toy.frozen_at_ready == 0  # not before it was ready
        assert gc.get_freeze_count() > 1000  # the modules, at least
        assert gc.get_threshold() == (runtime.GC_YOUNG, *threshold[1:])
    finally:
        toy.stop()
        await asyncio.wait_for(serving, 10)
        gc.unfreeze()
        gc.set_threshold(*threshold)
