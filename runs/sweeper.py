"""Recovery and liveness (DESIGN §3).

The sweeper runs in every ``runworker`` main process, every ``SWEEP_INTERVAL`` seconds
(django-q2 schedules run only about every 30 s: too coarse). It re-enqueues runnable runs
whose lease expired or that nobody claimed, wakes runs whose timer fell due, and runs the
hooks other apps register (approval expiry).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.db.models import Min, Q
from django.db.models.functions import Now
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.brokers.orm import ORM
from django_q.conf import Conf
from django_q.models import OrmQ

from runs.models import AgentManifest, Run
from runs.queue import enqueue_run
from runs.record.common import claimable

log = logging.getLogger(__name__)

# a hook may return what it did (a count): nobody reads it
_hooks: list[Callable[[], object]] = []


def register_sweep_hook(hook: Callable[[], object]) -> None:
    if hook not in _hooks:
        _hooks.append(hook)


# A wake-up is enqueued after the commit that stamps ``enqueued_at``: allow for that gap
# (and for clock skew between the machines that write the two timestamps).
_ENQUEUE_MARGIN = timedelta(seconds=5)


def oldest_waiting_wakeup() -> datetime | None:
    """When the oldest wake-up still waiting in the broker was enqueued (ORM broker only;
    None when the line is empty or the broker cannot tell)."""
    broker = get_broker()
    if not isinstance(broker, ORM):
        return None
    return (
        OrmQ.objects.using(Conf.ORM)
        .filter(key=broker.list_key, lock__lte=timezone.now())
        .aggregate(oldest=Min("lock"))["oldest"]
    )


def runnable_orphans(limit: int = 500) -> list:
    """Claimable runs with a free or expired lease, due, and not enqueued recently.

    "Recently" is ``REQUEUE_AFTER`` ago, or earlier while the broker holds a backlog: a run
    enqueued after the oldest wake-up still in line has its own wake-up behind it, and
    enqueuing it again would only lengthen the line (under a burst of new runs every sweep
    would add a duplicate of each, and the workers would spend their time on those)."""
    requeue_after = timedelta(seconds=settings.AGENTOPS["REQUEUE_AFTER"])
    not_recent = Q(enqueued_at__isnull=True) | Q(enqueued_at__lt=Now() - requeue_after)
    oldest = oldest_waiting_wakeup()
    if oldest is not None:
        not_recent &= Q(enqueued_at__isnull=True) | Q(enqueued_at__lt=oldest - _ENQUEUE_MARGIN)
    return list(
        # runnable, or waiting with a timer or timeout that fell due (also while no worker ran)
        Run.objects.filter(claimable())
        # remote agents' runs wait for an agent process; expired remote leases are handled
        # by runs.remote.remote_leases_expire (a sweep hook)
        .exclude(agent_name__in=AgentManifest.objects.values("name"))
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=Now()))
        .filter(Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
        .filter(not_recent)
        .order_by("created_at")
        .values_list("id", flat=True)[:limit]
    )


def sweep() -> int:
    """One pass. Returns how many runs were enqueued."""
    for hook in list(_hooks):
        try:
            hook()
        except (OperationalError, InterfaceError):
            # the connection is lost: every later hook would fail on it too, each with a
            # traceback. The caller (runworker) reconnects and sweeps again.
            raise
        except Exception:
            log.exception("sweep hook %s failed", getattr(hook, "__name__", hook))
    run_ids = runnable_orphans()
    if run_ids:
        Run.objects.filter(id__in=run_ids).update(enqueued_at=Now())
        for run_id in run_ids:
            enqueue_run(run_id)
    return len(run_ids)
