"""Prometheus metrics (docs/operations.md, "Health and metrics").

Two kinds, and the difference matters when reading them:

* **From the database, at scrape time** (``DatabaseCollector`` and the collectors other apps
  register): runs by status, runs needing attention by reason, open tool calls, unknown
  outcomes, recoveries, lease losses, usage, worker heartbeats, the step-duration
  histogram. They describe the whole deployment — every worker on every machine — whichever
  web process answers the scrape, so any number of gunicorn workers behind a load balancer
  give the same answer. ``*_total`` values are sums over the record: they only go down when
  runs are deleted.
* **In-process** (``CHECKPOINT_SECONDS``, ``MODEL_REQUEST_SECONDS``): latencies only the
  process that did the work can measure. Without ``PROMETHEUS_MULTIPROC_DIR`` a scrape sees
  the answering process's own observations only. With it set to the same empty directory for
  every process on a machine (gunicorn and ``runworker``, whose task processes are forks),
  prometheus_client aggregates them across those processes — per machine, not across
  machines.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from runs.record.eventtypes import EventType

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)
# the step-duration histogram covers the steps completed this long before the scrape
STEP_WINDOW_SECONDS = 900

# --- in-process ------------------------------------------------------------------------------

CHECKPOINT_SECONDS = Histogram(
    "agentops_checkpoint_seconds",
    "Time to commit one checkpoint (lock the run, append its events, update it), seconds. "
    "In-process: see docs/operations.md.",
    buckets=LATENCY_BUCKETS,
)
MODEL_REQUEST_SECONDS = Histogram(
    "agentops_model_request_seconds",
    "Time of one request to the LLM API (each attempt), seconds. In-process.",
    ["outcome"],
    buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
LEASE_LOST_IN_PROCESS = Counter(
    "agentops_process_lease_losses",
    "Incarnations this process stopped because another took the run's lease. In-process.",
)


# --- from the database -------------------------------------------------------------------------

_collectors: list[Callable[[], Iterable[Metric]]] = []


def register_collector(collect: Callable[[], Iterable[Metric]]) -> None:
    """Another app adds metrics computed at scrape time (approvals registers its own: runs
    never imports approvals)."""
    if collect not in _collectors:
        _collectors.append(collect)


def collect_runs() -> Iterator[Metric]:
    from runs.models import Run, RunEvent, Step, ToolCall

    # dry runs (issue 23) are counted apart: they are no throughput and spend nothing real
    # on their tools, so the run, step and usage figures below are of real runs only
    by_status: dict[tuple[str, bool], int] = {
        (status, dry): n
        for status, dry, n in Run.objects.values_list("status", "dry_run")
        .annotate(n=Count("id"))
        .order_by()
    }
    runs = GaugeMetricFamily("agentops_runs", "Runs by status (dry runs apart).", labels=["status"])
    dry_runs = GaugeMetricFamily(
        "agentops_dry_runs",
        "Dry runs by status: their tools with side effects were only simulated.",
        labels=["status"],
    )
    for status in Run.Status.values:
        runs.add_metric([status], by_status.get((status, False), 0))
        dry_runs.add_metric([status], by_status.get((status, True), 0))
    yield runs
    yield dry_runs

    attention = dict(
        # a dry run waiting for a person waits all the same: counted (it is no throughput)
        Run.objects.filter(status=Run.Status.NEEDS_ATTENTION)
        .values_list("reason_code")
        .annotate(n=Count("id"))
        .order_by()
    )
    needs = GaugeMetricFamily(
        "agentops_runs_needs_attention",
        "Runs waiting for a person, by reason code.",
        labels=["reason"],
    )
    for reason in Run.Reason.values:
        needs.add_metric([reason], attention.get(reason, 0))
    yield needs

    real, dry = Q(dry_run=False), Q(dry_run=True)
    usage = Run.objects.aggregate(
        # recoveries are the workers' health, not throughput: every run's
        recoveries=Sum("recovery_count"),
        steps=Sum("steps_used", filter=real),
        tokens=Sum("tokens_used", filter=real),
        cost=Sum("cost_used", filter=real),
        # a dry run's model is real and so is its bill: shown, apart
        dry_tokens=Sum("tokens_used", filter=dry),
        dry_cost=Sum("cost_used", filter=dry),
    )
    for name, key, text in (
        ("agentops_recoveries", "recoveries", "Times a run was recovered from a dead holder."),
        ("agentops_steps", "steps", "Steps taken by all runs (dry runs apart)."),
        ("agentops_tokens", "tokens", "Model tokens used by all runs (dry runs apart)."),
        (
            "agentops_cost",
            "cost",
            "Model cost recorded by all runs (the budgets' unit; dry runs apart).",
        ),
        ("agentops_dry_run_tokens", "dry_tokens", "Model tokens used by dry runs."),
        ("agentops_dry_run_cost", "dry_cost", "Model cost recorded by dry runs."),
    ):
        yield CounterMetricFamily(name, text, value=float(usage[key] or 0))

    open_calls = dict(
        ToolCall.objects.filter(status__in=ToolCall.OPEN)
        .values_list("status")
        .annotate(n=Count("id"))
        .order_by()
    )
    calls = GaugeMetricFamily(
        "agentops_tool_calls_open",
        "Tool calls not settled yet, by status (unknown: outcome in doubt).",
        labels=["status"],
    )
    for status in ToolCall.OPEN:
        calls.add_metric([str(status)], open_calls.get(status, 0))
    yield calls

    event_counts = dict(
        RunEvent.objects.filter(
            type__in=(EventType.TOOL_UNKNOWN, EventType.RUN_LEASE_LOST, EventType.AGENT_POSTPONED)
        )
        .values_list("type")
        .annotate(n=Count("id"))
        .order_by()
    )
    for name, type_, text in (
        (
            "agentops_unknown_outcomes",
            EventType.TOOL_UNKNOWN,
            "Tool calls whose outcome became unknown.",
        ),
        (
            "agentops_lease_losses",
            EventType.RUN_LEASE_LOST,
            "Incarnations that found their lease taken by another worker.",
        ),
        (
            "agentops_decisions_postponed",
            EventType.AGENT_POSTPONED,
            "Decisions postponed because the model API was unavailable.",
        ),
    ):
        yield CounterMetricFamily(name, text, value=event_counts.get(type_, 0))

    yield _step_histogram(Step)


def _step_histogram(step_model: Any) -> Metric:
    """One aggregate query (counts per bucket and the sum), not a row per step: a busy
    deployment completes many thousands of steps in the window."""
    from runs.dbtime import db_now

    since = db_now() - timedelta(seconds=STEP_WINDOW_SECONDS)
    duration = ExpressionWrapper(F("completed_at") - F("created_at"), output_field=DurationField())
    counts = {
        f"le_{index}": Count("id", filter=Q(duration__lte=timedelta(seconds=bound)))
        for index, bound in enumerate(STEP_BUCKETS)
    }
    row = (
        step_model.objects.filter(
            completed_at__gte=since, completed_at__isnull=False, run__dry_run=False
        )
        .annotate(duration=duration)
        .aggregate(total=Count("id"), sum=Sum("duration"), **counts)
    )
    buckets = [
        (_le(bound), row[f"le_{index}"] or 0) for index, bound in enumerate(STEP_BUCKETS)
    ] + [("+Inf", row["total"] or 0)]
    total = row["sum"]
    return GaugeHistogramMetricFamily(
        "agentops_step_duration_seconds",
        f"Steps completed in the last {STEP_WINDOW_SECONDS} s, by time from decision to "
        "completion (includes approval and wait time; dry runs apart), seconds.",
        buckets=buckets,
        gsum_value=total.total_seconds() if total is not None else 0.0,
    )


def _le(bound: float) -> str:
    return str(float(bound))


def collect_workers() -> Iterator[Metric]:
    from runs.dbtime import db_now
    from runs.models import Worker

    now = db_now()
    heartbeat = GaugeMetricFamily(
        "agentops_worker_heartbeat_age_seconds",
        "Seconds since each worker identity's last heartbeat.",
        labels=["worker", "host"],
    )
    last_task = GaugeMetricFamily(
        "agentops_worker_last_task_age_seconds",
        "Seconds since each worker last ran a task (since its start if none).",
        labels=["worker", "host"],
    )
    health = GaugeMetricFamily(
        "agentops_worker_health",
        "1 for each worker's current health (starting, healthy, frozen, stopped).",
        labels=["worker", "health"],
    )
    counts = {value: 0 for value in Worker.Health.values}
    for worker in Worker.objects.all():
        labels = [worker.name, worker.host]
        heartbeat.add_metric(labels, (now - worker.heartbeat_at).total_seconds())
        reference = worker.last_task_at or worker.started_at
        last_task.add_metric(labels, (now - reference).total_seconds())
        health.add_metric([worker.name, worker.health], 1)
        counts[worker.health] = counts.get(worker.health, 0) + 1
    workers = GaugeMetricFamily(
        "agentops_workers", "Worker identities by health.", labels=["health"]
    )
    for value, n in counts.items():
        workers.add_metric([value], n)
    yield from (heartbeat, last_task, health, workers)


def collect_outbox() -> Iterator[Metric]:
    """Emails and webhook deliveries (runs.outbox): how many in each state, and how many are
    being retried. ``failed`` ones were given up on after the maximum number of attempts:
    nobody was told what they said."""
    from runs.models import OutboxMessage, WebhookDelivery

    messages = GaugeMetricFamily(
        "agentops_outbox_messages",
        "Outbox messages (emails, webhook deliveries) by channel and status.",
        labels=["channel", "status"],
    )
    retrying = GaugeMetricFamily(
        "agentops_outbox_retrying",
        "Outbox messages still pending after at least one failed attempt.",
        labels=["channel"],
    )
    for channel, model, statuses in (
        ("email", OutboxMessage, OutboxMessage.Status.values),
        ("webhook", WebhookDelivery, WebhookDelivery.Status.values),
    ):
        counts = dict.fromkeys(statuses, 0)
        counts.update(model.objects.order_by().values_list("status").annotate(n=Count("id")))
        for status, n in counts.items():
            messages.add_metric([channel, status], n)
        pending_retries = model.objects.filter(status="pending", attempts__gt=0).count()
        retrying.add_metric([channel], pending_retries)
    yield from (messages, retrying)


class DatabaseCollector:
    """Everything computed from the database at scrape time."""

    def collect(self) -> Iterator[Metric]:
        yield from collect_runs()
        yield from collect_workers()
        yield from collect_outbox()
        for collect in list(_collectors):
            yield from collect()


def exposition() -> bytes:
    """The text exposition of the database metrics and the in-process ones (merged across
    this machine's processes when PROMETHEUS_MULTIPROC_DIR is set)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        for metric in (CHECKPOINT_SECONDS, MODEL_REQUEST_SECONDS, LEASE_LOST_IN_PROCESS):
            registry.register(metric)
    return generate_latest(registry)
