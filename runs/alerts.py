"""Operator alerts: a run that needs a person, a worker that stopped, no live worker at all.

Each alert has a *cause* that names exactly one occurrence ("this run entered
``needs_attention`` at event 17", "worker w-2 of boot <uuid> stopped heartbeating"), and
``Alert.cause`` is unique. Detection runs as often as the sweeper does, in every worker, and
may see the same occurrence thousands of times; only the process whose INSERT of the cause
succeeds notifies, so operators are emailed once per cause — never once per sweep, per
worker or per page refresh.

Notification goes through the outbox (``runs.outbox``, DESIGN §9): one email per operator
is written in the transaction that sets ``notified_at`` ("its emails are in the outbox"),
and sent after that commit, outside any transaction — by this process at once, else by any
worker's sweeper, retried with backoff while the mail server is down. An alert whose
creating process died before that transaction (its own commit came first) still has no
``notified_at`` after ``RETRY_AFTER``: a later pass claims it with a conditional UPDATE of
``notified_at`` in the same transaction that enqueues its email, so two sweepers enqueue it
once.

Webhooks: another app may append callables to ``ALERT_LISTENERS``; each is called once per
alert with the ``Alert`` after the email, and an exception in one is logged and does not stop
the others or the email.

Who is emailed: active users in the ``operator`` group that have an email address.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import EmailMessage
from django.db import IntegrityError, transaction
from django.db.models import BooleanField, Case, Max, OuterRef, Q, Subquery, Value, When
from django.db.models.functions import Now
from django.urls import NoReverseMatch, reverse

from runs import outbox
from runs.masking import maskers_for_ids
from runs.models import Alert, OutboxMessage, Run, RunEvent, Worker
from runs.record.eventtypes import EventType

log = logging.getLogger(__name__)

# Called as ``listener(alert)`` once per new alert, after commit (webhooks register here).
ALERT_LISTENERS: list[Callable[[Alert], None]] = []

OPERATOR_GROUP = "operator"
# at most this many new causes of each kind per pass (the rest are found by the next pass)
SCAN_LIMIT = 200
# an alert without notified_at older than this is enqueued by a later pass (the inserting
# process died between its insert and the enqueue)
RETRY_AFTER = timedelta(seconds=60)
# alerts older than this are history: never retried, never resolved again
HORIZON = timedelta(days=1)
ALERT_KIND = "alert"

_last_check = 0.0
_last_retry = 0.0


def alerts_sweep() -> int:
    """The sweep hook: at most one pass per ``ALERT_INTERVAL`` seconds in this process (the
    sweeper itself runs every second or faster). Returns how many alerts were sent."""
    global _last_check
    interval = settings.AGENTOPS.get("ALERT_INTERVAL", 5.0)
    if interval <= 0:
        return 0  # turned off: `manage.py check_alerts` (cron) is then the only checker
    now = time.monotonic()
    if _last_check and now - _last_check < interval:
        return 0
    _last_check = now
    return alerts_check()


def alerts_check() -> int:
    """Detect every current cause, create its alert once and notify; retry failed sends;
    mark alerts whose cause went away as resolved. Returns how many alerts were sent."""
    global _last_retry
    new = _run_alerts() + _worker_alerts()
    sent = _notify(new)
    for alert in new:
        _tell_listeners(alert)
    now = time.monotonic()
    if not _last_retry or now - _last_retry >= RETRY_AFTER.total_seconds():
        _last_retry = now
        sent += _notify(_unnotified())
    _resolve_gone()
    return sent


# --- detection -----------------------------------------------------------------------------


def _create(
    *, cause: str, kind: str, detail: str, run_id=None, worker_name: str = ""
) -> Alert | None:
    """The conditional insert: the alert if this process created it, None if another pass
    (here or in another worker) already did."""
    try:
        with transaction.atomic():
            return Alert.objects.create(
                cause=cause, kind=kind, run_id=run_id, worker_name=worker_name, detail=detail
            )
    except IntegrityError:
        return None


def _create_missing(candidates: list[dict]) -> list[Alert]:
    if not candidates:
        return []
    known = set(
        Alert.objects.filter(cause__in=[c["cause"] for c in candidates]).values_list(
            "cause", flat=True
        )
    )
    new = [c for c in candidates if c["cause"] not in known]
    # an alert is emailed and shown to everyone: a reason that quotes a value the agent read
    # (runs.masking) is stored masked. Only new alerts are masked: a sweep that creates none
    # costs no query.
    masks = maskers_for_ids({c["run_id"] for c in new if c.get("run_id")})
    created = []
    for candidate in new:
        if candidate.get("run_id") in masks:
            candidate = {**candidate, "detail": masks[candidate["run_id"]](candidate["detail"])}
        alert = _create(**candidate)
        if alert is not None:
            created.append(alert)
    return created


def _run_alerts() -> list[Alert]:
    """Runs in ``needs_attention``. The cause carries the seq of the ``run.needs_attention``
    event, so a run that is retried and parks again alerts again — once per time it parks."""
    latest_event = (
        RunEvent.objects.filter(run_id=OuterRef("pk"), type=EventType.RUN_NEEDS_ATTENTION)
        .order_by()
        .values("run_id")
        .annotate(seq=Max("seq"))
        .values("seq")
    )
    rows = (
        Run.objects.filter(status=Run.Status.NEEDS_ATTENTION)
        .annotate(parked_seq=Subquery(latest_event))
        .order_by("-updated_at")
        .values_list("id", "parked_seq", "agent_name", "reason_code", "reason_detail", "goal")[
            :SCAN_LIMIT
        ]
    )
    candidates = []
    for run_id, seq, agent, reason, reason_detail, goal in rows:
        detail = f"Run {run_id} ({agent}) needs attention: {reason or 'no reason recorded'}."
        if reason_detail:
            detail += f"\n{reason_detail}"
        if goal:
            detail += f"\nGoal: {goal}"
        candidates.append(
            {
                "cause": f"{Alert.Kind.RUN_NEEDS_ATTENTION}:{run_id}:{seq or 0}",
                "kind": Alert.Kind.RUN_NEEDS_ATTENTION,
                "detail": detail,
                "run_id": run_id,
            }
        )
    return _create_missing(candidates)


def _worker_alerts() -> list[Alert]:
    """A worker identity that is not stopped but whose heartbeat is stale died without
    releasing it; one that reports ``frozen`` is alive but runs nothing. Both are keyed by
    the boot id: the same process never alerts twice, a restarted one may. With no live
    worker at all, one more alert keyed by the newest heartbeat anyone sent: it stays the
    same for as long as nothing runs, and changes once a worker has lived again."""
    stale_after = timedelta(seconds=settings.AGENTOPS["WORKER_STALE_AFTER"])
    fresh = Q(heartbeat_at__gte=Now() - stale_after)
    workers = list(
        Worker.objects.exclude(health=Worker.Health.STOPPED)
        .annotate(
            alive=Case(
                When(fresh, then=Value(True)), default=Value(False), output_field=BooleanField()
            )
        )
        .filter(Q(alive=False) | Q(health=Worker.Health.FROZEN))
        .values_list("name", "boot_id", "host", "health", "heartbeat_at", "detail", "alive")[
            :SCAN_LIMIT
        ]
    )
    candidates = []
    for name, boot_id, host, health, heartbeat_at, detail, alive in workers:
        if not alive:
            candidates.append(
                {
                    "cause": f"{Alert.Kind.WORKER_STOPPED}:{name}:{boot_id}",
                    "kind": Alert.Kind.WORKER_STOPPED,
                    "worker_name": name,
                    "detail": (
                        f"Worker {name} on {host} stopped heartbeating "
                        f"(last heartbeat {heartbeat_at:%Y-%m-%d %H:%M:%S %Z}). Its leases "
                        "expire and other workers take its runs over."
                    ),
                }
            )
        else:
            candidates.append(
                {
                    "cause": f"worker_frozen:{name}:{boot_id}",
                    "kind": Alert.Kind.WORKER_STOPPED,
                    "worker_name": name,
                    "detail": f"Worker {name} on {host} looks frozen: {detail or health}.",
                }
            )
    live = (
        Worker.objects.exclude(health__in=[Worker.Health.STOPPED, Worker.Health.FROZEN])
        .filter(fresh)
        .exists()
    )
    if not live:
        newest = Worker.objects.aggregate(newest=Max("heartbeat_at"))["newest"]
        since = newest.isoformat() if newest else "never"
        candidates.append(
            {
                "cause": f"{Alert.Kind.NO_LIVE_WORKER}:{since}",
                "kind": Alert.Kind.NO_LIVE_WORKER,
                "detail": (
                    "No worker is running"
                    + (
                        f" (the last heartbeat was at {newest:%Y-%m-%d %H:%M:%S %Z})"
                        if newest
                        else ""
                    )
                    + ": no run advances until one starts (`python manage.py runworker`)."
                ),
            }
        )
    return _create_missing(candidates)


def alert_raise(*, cause: str, kind: str, detail: str, run_id=None) -> Alert | None:
    """Raise one alert for a cause a service saw happen (a spend cap at 80 %, runs.spend):
    created once per cause whoever sees it, emailed to operators and told to the listeners.
    Call it after the commit that made the cause true. None when the cause had its alert."""
    alert = _create(cause=cause, kind=kind, detail=detail, run_id=run_id)
    if alert is None:
        return None
    _notify([alert])
    _tell_listeners(alert)
    return alert


def _unnotified() -> list[Alert]:
    """Alerts whose emails were never enqueued (older than ``RETRY_AFTER``, so the process
    that created one is done with it); ``_notify`` claims them."""
    return list(
        Alert.objects.filter(
            notified_at__isnull=True,
            resolved_at__isnull=True,
            created_at__lt=Now() - RETRY_AFTER,
            created_at__gte=Now() - HORIZON,
        )[:SCAN_LIMIT]
    )


def _resolve_gone() -> None:
    """A run that left ``needs_attention``, a worker that heartbeats again, a cluster with a
    live worker: the alert is history (kept, with ``resolved_at``)."""
    stale_after = timedelta(seconds=settings.AGENTOPS["WORKER_STALE_AFTER"])
    open_alerts = Alert.objects.filter(resolved_at__isnull=True, created_at__gte=Now() - HORIZON)
    open_alerts.filter(kind=Alert.Kind.RUN_NEEDS_ATTENTION).exclude(
        run__status=Run.Status.NEEDS_ATTENTION
    ).update(resolved_at=Now())
    live = Worker.objects.exclude(health__in=[Worker.Health.STOPPED, Worker.Health.FROZEN]).filter(
        heartbeat_at__gte=Now() - stale_after
    )
    open_alerts.filter(kind=Alert.Kind.WORKER_STOPPED, worker_name__in=live.values("name")).update(
        resolved_at=Now()
    )
    if live.exists():
        open_alerts.filter(kind=Alert.Kind.NO_LIVE_WORKER).update(resolved_at=Now())


# --- notification --------------------------------------------------------------------------


def operator_emails() -> list[str]:
    return sorted(
        set(
            get_user_model()
            .objects.filter(groups__name=OPERATOR_GROUP, is_active=True)
            .exclude(email="")
            .values_list("email", flat=True)
        )
    )


def _link_dashboard() -> str:
    base = settings.AGENTOPS["BASE_URL"].rstrip("/")
    try:
        return base + reverse("runs:dashboard")
    except NoReverseMatch:
        return base + "/"


def _link(alert: Alert) -> str:
    base = settings.AGENTOPS["BASE_URL"].rstrip("/")
    try:
        if alert.run_id:
            return base + reverse("runs:detail", args=[alert.run_id])
        return base + reverse("runs:dashboard")
    except NoReverseMatch:
        return base + "/"


def _subject(alert: Alert) -> str:
    if alert.kind == Alert.Kind.RUN_NEEDS_ATTENTION:
        return f"[agentops] Run {str(alert.run_id)[:8]} needs attention"
    if alert.kind == Alert.Kind.NO_LIVE_WORKER:
        return "[agentops] No worker is running"
    if alert.kind == Alert.Kind.SPEND_CAP:
        level = alert.cause.rsplit(":", 1)[-1]
        return f"[agentops] Spend cap {level} % used"
    if alert.cause.startswith("worker_frozen:"):
        return f"[agentops] Worker {alert.worker_name} looks frozen"
    return f"[agentops] Worker {alert.worker_name} stopped"


def _message(alerts: list[Alert]) -> tuple[str, str]:
    """Subject and body: one alert on its own, or a digest when a pass found several at
    once (a database outage can park hundreds of runs: one email, not hundreds)."""
    if len(alerts) == 1:
        alert = alerts[0]
        return (
            _subject(alert),
            f"{alert.detail}\n\nOpen the console: {_link(alert)}\n\nAlert cause: {alert.cause}\n",
        )
    kinds = Counter(
        "runs need attention"
        if a.kind == Alert.Kind.RUN_NEEDS_ATTENTION
        else "spend caps"
        if a.kind == Alert.Kind.SPEND_CAP
        else "worker problems"
        for a in alerts
    )
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    lines = [f"- {_subject(a).removeprefix('[agentops] ')}: {_link(a)}" for a in alerts]
    body = (
        f"{len(alerts)} new alerts ({summary}).\n\n"
        + "\n".join(lines)
        + "\n\nDetails of each are on the dashboard: "
        + _link_dashboard()
        + "\n"
    )
    return f"[agentops] {len(alerts)} alerts: {summary}", body


def _notify(alerts: list[Alert]) -> int:
    """Email every operator (one message each: addresses are not shared) about these alerts:
    one email for one alert, one digest for several. The emails are enqueued in the
    transaction that sets ``notified_at`` (a conditional UPDATE: of two passes that found
    the same unnotified alert, one enqueues it) and sent after it. Returns how many alerts
    had their emails sent now (the outbox retries the others)."""
    if not alerts:
        return 0
    with transaction.atomic():
        mine = [
            alert
            for alert in alerts
            if Alert.objects.filter(id=alert.id, notified_at__isnull=True).update(notified_at=Now())
        ]
        if not mine:
            return 0
        subject, body = _message(mine)
        ids = outbox.emails_enqueue(
            outbox.Email(
                kind=ALERT_KIND,
                to_address=address,
                payload={"subject": subject, "body": body, "alerts": [a.id for a in mine]},
            )
            for address in operator_emails()
        )
    # the sweeper (or check_alerts) is this process: send now, not only on commit
    # callbacks (a sweep hook may run inside a caller's transaction, tests do)
    sent = outbox.emails_send(ids)
    if sent < len(ids):
        return 0
    for alert in mine:
        log.warning("ALERT %s: emailed %d operator(s)", alert.cause, len(ids))
    return len(mine)


def _render(row: OutboxMessage) -> EmailMessage:
    # rendered when enqueued (an alert's text is about that moment, not the send's)
    return EmailMessage(subject=row.payload["subject"], body=row.payload["body"])


def install() -> None:
    """Called from ``RunsConfig.ready``."""
    outbox.register_kind(ALERT_KIND, render=_render)


def _tell_listeners(alert: Alert) -> None:
    """Once per alert, whatever became of the email."""
    for listener in list(ALERT_LISTENERS):
        try:
            listener(alert)
        except Exception:
            log.exception("alert listener %s failed", getattr(listener, "__name__", listener))
