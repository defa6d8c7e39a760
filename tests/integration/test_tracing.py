"""One trace per task: producer, scheduler and executor spans, read from an in-memory exporter.

The scheduler and the executor run in this process (real Postgres, Redis, RabbitMQ; the
executor's worker processes are real) so that one exporter sees every span.
"""

from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from shared.fsm import State
from shared.settings import Settings
from tests.integration.pipeline import pipeline


def trace_of(task_traceparent: str | None) -> int:
    assert task_traceparent is not None
    return int(task_traceparent.split("-")[1], 16)


async def test_one_trace_holds_producer_scheduler_and_executor_spans_in_order(
    settings: Settings, spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    # the dispatch message waits long enough to be surely needless (follow.py)
    followed = settings.model_copy(update={"dispatch_follow_s": 5.0})
    async with pipeline(settings, tmp_path, "traced", followed) as (_, client):
        task_id = await client.submit(
            {"name": "traced", "job": {"kind": "handler", "handler": "tests.e2e.jobs:noop"}}
        )
        task = await client.wait(task_id, timeout=30)
    assert task.status is State.SUCCESS

    trace_id = trace_of(task.traceparent)
    mine: list[ReadableSpan] = [
        sp for sp in spans.get_finished_spans() if sp.context and sp.context.trace_id == trace_id
    ]
    mine.sort(key=lambda sp: sp.start_time or 0)
    names = [sp.name for sp in mine]

    def first(name: str) -> ReadableSpan:
        found = [sp for sp in mine if sp.name == name]
        assert found, f"no span {name!r} in {names}"
        return found[0]

    producer = first("sked.tasks publish")
    received = first("sked.submit receive")
    run = first("attempt 1 run")
    assert producer.kind is SpanKind.PRODUCER
    assert received.kind is SpanKind.CONSUMER
    # a span per transition, every one in this trace
    transitions = [n for n in names if "→" in n]
    assert transitions == [
        "Created → Pending",
        "Pending → Ready",
        "Ready → Scheduling",
        "Scheduling → Running",
        "Running → Success",
    ], names
    # producer first, then the scheduler's spans, then the executor's
    order = [producer, received, first("Ready → Scheduling"), run, first("Running → Success")]
    starts = [sp.start_time for sp in order]
    assert starts == sorted(starts), [sp.name for sp in order]
    # parentage: the consumer spans hang under the producer spans whose context they carried
    assert received.parent is not None
    assert received.parent.span_id == producer.context.span_id
    assert run.parent is not None
    consumed = [sp for sp in mine if sp.name == "sked.node.traced receive"]
    if consumed:  # started from its dispatch message
        dispatched = first("sked.dispatch publish")
        assert dispatched.kind is SpanKind.PRODUCER
        assert consumed[0].kind is SpanKind.CONSUMER
        assert consumed[0].parent is not None
        assert consumed[0].parent.span_id == dispatched.context.span_id
        assert run.parent.span_id == consumed[0].context.span_id
    else:  # started from its placement's notification: under the task, and its dispatch
        # message, needed only by an attempt still unclaimed a moment later, never sent
        assert run.parent.span_id == producer.context.span_id
        assert "sked.dispatch publish" not in names, names
    # and nothing of this task landed in another trace
    others = [
        sp
        for sp in spans.get_finished_spans()
        if sp.attributes
        and sp.attributes.get("sked.task_id") == str(task_id)
        and sp.context.trace_id != trace_id
    ]
    assert not others, [sp.name for sp in others]
