"""Fixtures the integration suites share."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.executor.backends.local import LocalBackend
from services.executor.service import Executor
from shared import telemetry
from shared.settings import Settings
from shared.wiring import backends


@pytest.fixture
async def executor(settings: Settings, tmp_path: Path) -> AsyncIterator[Executor]:
    """An executor of node n1 with 2 slots on the local backend, its loops not running: a
    test drives its starter and finisher itself."""
    node = settings.model_copy(update={"node_id": "n1", "slots": 2})
    async with backends(node) as b:
        backend = LocalBackend(2, tmp_path, warm_workers=0)
        await backend.start()
        try:
            yield Executor(node, b.store, b.bus, backend, b.ready_queue)
        finally:
            await backend.close()


# One tracer provider a process (OpenTelemetry takes the first): every test module that reads
# spans shares this exporter.
_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The in-memory exporter behind this process's tracer provider (installed once)."""
    if not telemetry.enabled():
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        telemetry.use(provider)
    assert isinstance(trace.get_tracer_provider(), TracerProvider)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()
