"""Trace continuity (issue 3, item 6): one W3C trace per run for its whole life, one span per
incarnation.

A run's ``trace_id`` (32 hex digits, set when it is created) never changes: every incarnation
— whichever worker, however many crashes later — opens a span in that same trace, parented
to a synthetic root span derived from the run id, so a tracing backend shows the run's whole
story as one trace. Events record the trace id and the span id of the incarnation that wrote
them.

OpenTelemetry is optional (``pip install agentops[otel]``) and off by default. It is on when
the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (spans then go out through the OTLP/HTTP
exporter), or when a test calls :func:`configure` with its own tracer provider. Off, every
function here is a cheap no-op: the hot path pays one attribute check.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

TRACER_NAME = "agentops.runs"

_tracer: Any = None  # an opentelemetry Tracer once configured; None while tracing is off
_configured_from_env = False


def root_span_id(run_id: Any) -> int:
    """The run's synthetic root span: the same for every incarnation of the run."""
    return int.from_bytes(hashlib.sha256(f"run:{run_id}".encode()).digest()[:8], "big") or 1


def configure(provider: Any = None) -> bool:
    """Turn tracing on with ``provider`` (an SDK TracerProvider), or from the environment
    when none is given. Returns whether tracing is on."""
    global _tracer
    if provider is None and not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        # off: opentelemetry is not even imported (about 50 ms in every task process, at
        # its first task: on the path of a worker's cold start)
        _tracer = None
        return False
    try:
        from opentelemetry import trace
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry is not installed")
        _tracer = None
        return False
    if provider is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        service = os.environ.get("OTEL_SERVICE_NAME", "agentops-worker")
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _tracer = trace.get_tracer(TRACER_NAME, tracer_provider=provider)
    return True


def disable() -> None:
    global _tracer
    _tracer = None


def configure_from_env_once() -> None:
    """Called by worker processes when they start (idempotent)."""
    global _configured_from_env
    if not _configured_from_env:
        _configured_from_env = True
        if configure():
            log.info(
                "OpenTelemetry tracing on: spans to %s",
                os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
            )


@contextmanager
def incarnation_span(
    *, run_id: Any, trace_id: str, fence: int, worker: str, recovered: bool, agent: str
) -> Iterator[Any]:
    """The span of one incarnation: from its claim to the moment it lets go of the lease."""
    if _tracer is None or not trace_id:
        yield None
        return
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

    parent = SpanContext(
        trace_id=int(trace_id, 16),
        span_id=root_span_id(run_id),
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    context = trace.set_span_in_context(NonRecordingSpan(parent))
    with _tracer.start_as_current_span(
        "run.incarnation",
        context=context,
        kind=SpanKind.INTERNAL,
        attributes={
            "agentops.run_id": str(run_id),
            "agentops.incarnation": fence,
            "agentops.worker": worker,
            "agentops.recovered": recovered,
            "agentops.agent": agent,
        },
    ) as span:
        yield span


def current_span_id(trace_id: str) -> str:
    """The span id (16 hex digits) of the incarnation span in progress for ``trace_id``, or
    "" when tracing is off or no such span is current (a service call from a web request)."""
    if _tracer is None:
        return ""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid or format(context.trace_id, "032x") != trace_id:
        return ""
    return format(context.span_id, "016x")


def set_outcome(span: Any, outcome: str) -> None:
    if span is not None:
        span.set_attribute("agentops.outcome", outcome)
