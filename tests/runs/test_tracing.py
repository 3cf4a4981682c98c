"""Trace continuity: one W3C trace per run for its whole life, one span per incarnation,
events carrying the trace and the span that wrote them. Exported through the real
OpenTelemetry SDK into its in-memory exporter."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.conf import settings

from approvals.services import approval_decide
from runs import tracing
from runs.actors import Actor
from runs.models import Run, RunEvent
from runs.services import run_create
from tests.conftest import drive

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

LARGE = {"order_id": "ord_1004", "amount_cents": 20_000}  # waits for an approval


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert tracing.configure(provider)
    yield exporter
    tracing.disable()


@pytest.mark.django_db
def test_every_incarnation_is_a_span_in_the_runs_one_trace(
    spans, sandbox, roles, approver, system_actor
):
    run = run_create(agent_name="refund", input=LARGE, actor=system_actor)
    assert drive(run.id).status == Run.Status.WAITING_APPROVAL
    approval = run.approvals.get()
    approval_decide(
        approval_id=approval.id, decision="approve", actor=Actor.for_user(approver, "web")
    )
    run = drive(run.id, worker="another-worker")
    assert run.status == Run.Status.SUCCEEDED

    finished = [s for s in spans.get_finished_spans() if s.name == "run.incarnation"]
    assert len(finished) >= 2
    assert {format(s.context.trace_id, "032x") for s in finished} == {run.trace_id}
    # all parented to the run's synthetic root, so a backend shows one tree per run
    assert {s.parent.span_id for s in finished} == {tracing.root_span_id(run.id)}
    incarnations = [s.attributes["agentops.incarnation"] for s in finished]
    assert incarnations == sorted(set(incarnations))
    assert {s.attributes["agentops.worker"] for s in finished} == {
        "test-worker",
        "another-worker",
    }
    assert finished[-1].attributes["agentops.outcome"] == "parked"

    # each event names the trace, and the span of the incarnation that wrote it
    span_of = {
        s.attributes["agentops.incarnation"]: format(s.context.span_id, "016x") for s in finished
    }
    worker_events = RunEvent.objects.filter(run=run, channel="worker")
    assert worker_events.exists()
    for event in worker_events:
        assert event.trace_id == run.trace_id
        assert event.span_id == span_of[event.incarnation]
    # the approver's decision came from a web request, outside any incarnation span
    decided = RunEvent.objects.get(run=run, type="approval.decided")
    assert (decided.trace_id, decided.span_id) == (run.trace_id, "")


@pytest.mark.django_db
def test_tracing_is_off_without_an_endpoint(monkeypatch, sandbox, system_actor):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert tracing.configure() is False
    run = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1001", "amount_cents": 300},
            actor=system_actor,
        ).id
    )
    assert run.status == Run.Status.SUCCEEDED
    assert set(RunEvent.objects.filter(run=run).values_list("span_id", flat=True)) == {""}
    assert set(RunEvent.objects.filter(run=run).values_list("trace_id", flat=True)) == {
        run.trace_id
    }


def test_tracing_off_does_not_load_opentelemetry(monkeypatch):
    # every task process of a worker sets tracing up at its first task: when it is off, that
    # costs nothing (importing opentelemetry would delay a cold start's first step)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    code = (
        "import sys; from runs import tracing; "
        "assert tracing.configure() is False; "
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=settings.BASE_DIR, check=True)
