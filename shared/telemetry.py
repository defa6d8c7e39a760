"""Tracing: one trace per task, from the producer's submit to the terminal state.

The producer's span is the task's root; its W3C `traceparent` travels in AMQP headers and is
stored with the task (`tasks.traceparent`), so every later span — a transition made by any
service, a dispatch, an attempt's run — joins the same trace. Spans follow the OpenTelemetry
messaging conventions (PRODUCER / CONSUMER). Export is OTLP over HTTP when
OTEL_EXPORTER_OTLP_ENDPOINT is set; without a configured provider every call here is a no-op.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from uuid import UUID

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind

from shared import hooks

if TYPE_CHECKING:
    from shared.fsm import Move
    from shared.models import Task

TRACER = "sked"
_enabled = False


def setup(service_name: str) -> None:
    """Install a tracer provider for this process (services call this once at start).

    Exports with OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set; OTEL_SERVICE_NAME, if set,
    overrides `service_name`.
    """
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(
        resource=Resource.create({"service.name": name}),
        span_limits=SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS),
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    use(provider)


def use(provider: Any) -> None:
    """Make `provider` the tracer provider (tests pass one with an in-memory exporter), and
    plug tracing into sked's hooks."""
    global _enabled
    trace.set_tracer_provider(provider)
    if not _enabled:
        hooks.install(TracingHook())
    _enabled = True


def enabled() -> bool:
    """False until a provider is installed: hot paths skip building spans at all."""
    return _enabled


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER)


def inject(headers: MutableMapping[str, Any], ctx: otel_context.Context | None = None) -> None:
    propagate.inject(headers, context=ctx)


def extract(headers: Mapping[str, Any] | None) -> otel_context.Context:
    carrier = {k: str(v) for k, v in (headers or {}).items() if isinstance(v, str | bytes)}
    return propagate.extract(carrier)


def context_of(traceparent: str | None) -> otel_context.Context:
    """The context a stored traceparent names (an empty one if there is none)."""
    return propagate.extract({"traceparent": traceparent} if traceparent else {})


def traceparent_of(span: Span) -> str | None:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


@contextmanager
def span(
    name: str,
    parent: str | otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span]:
    """A span under `parent` (a stored traceparent, or a context)."""
    ctx = context_of(parent) if isinstance(parent, str | None) else parent
    with tracer().start_as_current_span(
        name, context=ctx, kind=kind, attributes=_clean(attributes or {})
    ) as current:
        yield current


def start(
    name: str,
    parent: str | otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> Span:
    """Start a span the caller ends (for work spread over a batch)."""
    ctx = context_of(parent) if isinstance(parent, str | None) else parent
    return tracer().start_span(name, context=ctx, kind=kind, attributes=_clean(attributes or {}))


def headers_for(current: Span, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """`headers` plus the W3C context of `current`, for a message sent under it."""
    out = dict(headers or {})
    propagate.inject(out, context=trace.set_span_in_context(current))
    return out


def transitions(moves: Sequence[tuple[Any, Any]], start_ns: int, end_ns: int) -> None:
    """One span per recorded transition, under its task's trace: (task after, move) pairs,
    with the statement's own start and end, so every state change of every task shows in its
    trace however it was made."""
    t = tracer()
    for task, move in moves:
        s = t.start_span(
            f"{move.source.label} → {move.target.label}",
            context=context_of(task.traceparent),
            start_time=start_ns,
            attributes=_clean(
                {
                    "sked.task_id": str(task.id),
                    "sked.task_name": task.name,
                    "sked.version": task.version,
                    "sked.attempt": task.attempt,
                    "sked.from": move.source.value,
                    "sked.to": move.target.value,
                    "sked.reason": move.reason,
                    "sked.node": task.node,
                }
            ),
        )
        s.end(end_time=end_ns)


def messaging(destination: str, operation: str, task_id: Any, **more: Any) -> dict[str, Any]:
    """Attributes of a messaging span (OpenTelemetry semantic conventions), plus sked's."""
    return {
        "messaging.system": "rabbitmq",
        "messaging.destination.name": destination,
        "messaging.operation": operation,
        "sked.task_id": str(task_id),
        **{f"sked.{k}": v for k, v in more.items()},
    }


# The longest text a span attribute carries: errors and reasons come from tasks and producers
# (an attempt's error once exported 300 KB a span), and OpenTelemetry bounds none by default.
MAX_ATTRIBUTE_CHARS = 2000


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _bounded(v) for k, v in attributes.items() if v is not None}


def _bounded(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_ATTRIBUTE_CHARS:
        return value[:MAX_ATTRIBUTE_CHARS] + " …[cut]"
    return value


class TracingHook(hooks.Hook):
    """Tracing at sked's seams: a span per transition, per submission received, per dispatch
    sent, and around each attempt, all in the task's trace."""

    def transitions(self, moved: Sequence[tuple[Task, Move]], start_ns: int, end_ns: int) -> None:
        transitions(moved, start_ns, end_ns)

    def received(
        self, queue: str, task_ids: Sequence[UUID], parents: Sequence[str | None]
    ) -> tuple[list[str | None], list[Any]]:
        contexts: list[str | None] = []
        handles: list[Any] = []
        for task_id, parent in zip(task_ids, parents, strict=True):
            if parent is None:  # a producer without tracing: the task's trace starts here
                with span("sked task", attributes={"sked.task_id": str(task_id)}) as root:
                    parent = traceparent_of(root)
            contexts.append(parent)
            handles.append(
                start(
                    f"{queue} receive",
                    parent,
                    SpanKind.CONSUMER,
                    messaging(queue, "receive", task_id),
                )
            )
        return contexts, handles

    def dispatching(self, tasks: Sequence[Task]) -> tuple[list[dict[str, Any]], list[Any]]:
        spans = [
            start(
                "sked.dispatch publish",
                t.traceparent,
                SpanKind.PRODUCER,
                messaging("sked.dispatch", "publish", t.id, node=t.node, attempt=t.attempt),
            )
            for t in tasks
        ]
        return [headers_for(s) for s in spans], spans

    def finished(self, handles: Sequence[Any]) -> None:
        for handle in handles:
            if isinstance(handle, Span):
                handle.end()

    @contextmanager
    def attempt(
        self, task: Task, node: str, headers: Mapping[str, Any] | None
    ) -> Iterator[hooks.Attempt]:
        parent: str | otel_context.Context | None = task.traceparent
        if headers:  # its dispatch message: received under the publish whose context it carried
            queue = f"sked.node.{node}"
            received = start(
                f"{queue} receive",
                extract(headers),
                SpanKind.CONSUMER,
                messaging(queue, "receive", task.id, attempt=task.attempt),
            )
            received.end()
            parent = trace.set_span_in_context(received)
        # else told by its placement's own commit (no message), or adopted: under the task
        with span(
            f"attempt {task.attempt} run",
            parent,
            attributes={"sked.task_id": str(task.id), "sked.node": node},
        ) as run:
            yield _SpanAttempt(run)


class _SpanAttempt(hooks.Attempt):
    def __init__(self, run: Span) -> None:
        self.run = run

    def ended(self, ok: bool, error: str | None) -> None:
        self.run.set_attribute("sked.ok", ok)
        if error:
            self.run.set_attribute("sked.error", _bounded(error))
