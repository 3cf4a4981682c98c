"""Recovery and liveness (DESIGN §3).

The sweeper runs in every ``runworker`` main process, every ``SWEEP_INTERVAL`` seconds
(django-q2 schedules run only about every 30 s: too coarse). It re-enqueues runnable runs
whose lease expired or that nobody claimed, wakes runs whose timer fell due, and runs the
hooks other apps register (approval expiry).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.db.models.functions import Now

from runs.models import AgentManifest, Run
from runs.queue import enqueue_run
from runs.waits import claimable

log = logging.getLogger(__name__)

_hooks: list[Callable[[], None]] = []


def register_sweep_hook(hook: Callable[[], None]) -> None:
    if hook not in _hooks:
        _hooks.append(hook)


def runnable_orphans(limit: int = 500) -> list:
    """Claimable runs with a free or expired lease, due, and not enqueued recently."""
    requeue_after = timedelta(seconds=settings.AGENTOPS["REQUEUE_AFTER"])
    return list(
        # runnable, or waiting with a timer or timeout that fell due (also while no worker ran)
        Run.objects.filter(claimable())
        # remote agents' runs wait for an agent process; expired remote leases are handled
        # by runs.remote.remote_leases_expire (a sweep hook)
        .exclude(agent_name__in=AgentManifest.objects.values("name"))
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=Now()))
        .filter(Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
        .filter(Q(enqueued_at__isnull=True) | Q(enqueued_at__lt=Now() - requeue_after))
        .order_by("created_at")
        .values_list("id", flat=True)[:limit]
    )


def sweep() -> int:
    """One pass. Returns how many runs were enqueued."""
    for hook in list(_hooks):
        try:
            hook()
        except Exception:
            log.exception("sweep hook %s failed", getattr(hook, "__name__", hook))
    run_ids = runnable_orphans()
    if run_ids:
        Run.objects.filter(id__in=run_ids).update(enqueued_at=Now())
        for run_id in run_ids:
            enqueue_run(run_id)
    return len(run_ids)
