"""Approval metrics for ``/metrics``, computed from the database at scrape time (registered
with ``runs.metrics`` when the app loads: runs never imports approvals)."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count, Min
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from approvals.models import Approval
from runs.dbtime import db_now


def collect_approvals() -> Iterator[Metric]:
    now = db_now()
    by_status = dict(Approval.objects.values_list("status").annotate(n=Count("id")).order_by())
    pending = Approval.objects.filter(status=Approval.Status.PENDING)
    oldest = pending.aggregate(oldest=Min("requested_at"))["oldest"]
    yield GaugeMetricFamily(
        "agentops_approvals_pending",
        "Approvals waiting for a decision.",
        value=by_status.get(Approval.Status.PENDING, 0),
    )
    yield GaugeMetricFamily(
        "agentops_approvals_overdue",
        "Pending approvals past their expiry that the sweeper has not expired yet "
        "(should stay 0: if not, no worker is sweeping).",
        value=pending.filter(expires_at__lte=now).count(),
    )
    yield GaugeMetricFamily(
        "agentops_approvals_oldest_pending_age_seconds",
        "Age of the oldest pending approval (0 when none).",
        value=(now - oldest).total_seconds() if oldest else 0,
    )
    decided = CounterMetricFamily(
        "agentops_approvals_settled",
        "Approvals settled, by how (approved, rejected, expired, cancelled).",
        labels=["status"],
    )
    for status in Approval.Status.values:
        if status != Approval.Status.PENDING:
            decided.add_metric([status], by_status.get(status, 0))
    yield decided
