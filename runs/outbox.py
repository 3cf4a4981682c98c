"""The outbox (DESIGN §9 "Messages are part of the record"): every email is an
``OutboxMessage`` row written in the transaction whose state change calls for it, and every
webhook a ``WebhookDelivery`` row written with its event (``runs.webhooks``). Both are sent
the same way:

1. **claimed** by a conditional UPDATE in database time: a fresh ``claim_token``, and
   ``next_attempt_at`` moved ``OUTBOX_CLAIM_SECONDS`` ahead, out of other drainers' reach;
2. **checked** just before the send, in one query: still pending, still this claim, and
   enough of the claim left for the send to finish (``OUTBOX_SEND_TIMEOUT``) before anyone
   may take it over. A drainer frozen after its claim (a VM pause, a long GC) that wakes
   after a takeover sends nothing;
3. **sent** outside any transaction, with a stable Message-ID (webhooks: the delivery id);
4. **marked** sent after — unconditionally, because a send that happened is a fact; a
   failed attempt is recorded only by the claim's holder, and retried with exponential
   backoff, ``OUTBOX_MAX_ATTEMPTS`` in all, then ``failed`` (dashboard, ``/metrics``).

The one window left is a crash or a pause between the send and the mark (``notify_sent``):
the message goes out again, with the same Message-ID, so a mail client or a webhook
receiver can tell it is the same message. Never lost, at worst twice (the chaos harness
counts these: ``duplicate_notifications``).

Who drains: the process that committed, right after its commit (a worker, or the web
process that decided an approval), and every worker's sweeper (``outbox_drain_due``) for
whatever that process did not get to — it was killed (``notify_enqueued``), the mail server
was down, a retry fell due.

Apps say how their emails look with ``register_kind``; ``runs`` never imports them (the
renderer receives the row and builds the message from its payload).
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage, get_connection
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from runs import faults
from runs.models import OutboxMessage

log = logging.getLogger(__name__)

# what the pre-send check leaves between it and the end of the send, beyond the send
# timeout itself (both read the database's clock: no skew to allow for)
SEND_MARGIN = 1.0
# a sweep pass sends for at most this long (the sweeper also recovers runs)
DRAIN_BUDGET_SECONDS = 5.0


def _conf(name: str, default: Any) -> Any:
    return settings.AGENTOPS.get(name, default)


def claim_seconds() -> float:
    return float(_conf("OUTBOX_CLAIM_SECONDS", 30.0))


def send_timeout() -> float:
    return float(_conf("OUTBOX_SEND_TIMEOUT", 10.0))


def max_attempts() -> int:
    return int(_conf("OUTBOX_MAX_ATTEMPTS", 8))


def backoff(attempts: int) -> float:
    base = float(_conf("OUTBOX_BACKOFF", 5.0))
    return min(base * (2 ** max(attempts - 1, 0)), 3600.0)


# --- what each kind of email looks like ---------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    # the message for this row, or None when it is no longer wanted (cancelled, not sent)
    render: Callable[[OutboxMessage], EmailMessage | None]
    # after each attempt: "" when it was sent, else the error (events on the run)
    recorded: Callable[[OutboxMessage, str], None] | None = None


_kinds: dict[str, Kind] = {}


def register_kind(
    name: str,
    *,
    render: Callable[[OutboxMessage], EmailMessage | None],
    recorded: Callable[[OutboxMessage, str], None] | None = None,
) -> None:
    _kinds[name] = Kind(render=render, recorded=recorded)


# other rows the sweep hook sends after the emails (webhook deliveries: ``runs.webhooks``
# registers its own, so this module never imports it); each takes ``limit`` and returns how
# many it sent
_drains: list[Callable[..., int]] = []


def register_drain(drain: Callable[..., int]) -> None:
    if drain not in _drains:
        _drains.append(drain)


# --- writing (inside the calling transaction) -----------------------------------------------------


@dataclass(frozen=True)
class Email:
    kind: str
    to_address: str
    payload: dict[str, Any]
    recipient_id: Any = None
    run_id: Any = None


def _message_id() -> str:
    domain = settings.DEFAULT_FROM_EMAIL.rpartition("@")[2].strip("> ") or "agentops"
    return f"<{uuid.uuid4().hex}@{domain}>"


def emails_enqueue(emails: Iterable[Email]) -> list[int]:
    """Inside the transaction that calls for them: one row each. After that transaction
    commits this process tries to send them at once; if it dies first, a sweeper does."""
    rows = OutboxMessage.objects.bulk_create(
        OutboxMessage(
            message_id=_message_id(),
            kind=email.kind,
            to_address=email.to_address,
            recipient_id=email.recipient_id,
            run_id=email.run_id,
            payload=email.payload,
        )
        for email in emails
    )
    ids = [row.id for row in rows]
    if ids:
        # robust: a failing send must not hide from the engine the commit that already
        # happened (it would take a committed wait for a failed one)
        transaction.on_commit(partial(_committed, ids), robust=True)
    return ids


def enqueued_on_commit() -> None:
    """For other outbox rows (webhook deliveries): the ``notify_enqueued`` fault point after
    the commit that wrote them; the sweeper sends them."""
    transaction.on_commit(partial(faults.crash_point, "notify_enqueued"))


def _committed(ids: list[int]) -> None:
    # DESIGN §9 contract point: the rows are committed, nothing is sent yet
    faults.crash_point("notify_enqueued")
    emails_send(ids)


# --- sending (never inside a transaction) ---------------------------------------------------------


def due() -> Q:
    return Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=Now())


def claim(model: Any, row_id: Any, *, attempts: int) -> str:
    """The conditional UPDATE: this drainer's claim token, or "" when another drainer holds
    the row, it is not due, or it was sent or settled since it was read."""
    token = secrets.token_hex(16)
    claimed = (
        model.objects.filter(id=row_id, status="pending", attempts=attempts)
        .filter(due())
        .update(claim_token=token, next_attempt_at=Now() + timedelta(seconds=claim_seconds()))
    )
    if claimed != 1:
        return ""
    # a paused drainer's claim can be taken over; the pre-send check then refuses it
    faults.crash_point("notify_claimed")
    return token


def still_claimed(model: Any, row_id: Any, claim_token: str) -> bool:
    """The pre-send check: one query, database time. False when the row was sent or taken
    over meanwhile, or when too little of the claim is left for the send to end inside it."""
    left = timedelta(seconds=send_timeout() + SEND_MARGIN)
    return model.objects.filter(
        id=row_id, status="pending", claim_token=claim_token, next_attempt_at__gt=Now() + left
    ).exists()


def attempt_failed(model: Any, row: Any, claim_token: str, error: str, *, permanent: bool) -> bool:
    """Record a failed attempt (only the claim's holder may). True when it gave up."""
    attempts = row.attempts + 1
    give_up = permanent or attempts >= max_attempts()
    model.objects.filter(id=row.id, status="pending", claim_token=claim_token).update(
        status="failed" if give_up else "pending",
        attempts=attempts,
        last_error=error[:2000],
        claim_token="",
        next_attempt_at=None if give_up else Now() + timedelta(seconds=backoff(attempts)),
    )
    return give_up


def emails_send(ids: Iterable[int]) -> int:
    """Send these rows if they are due and nobody holds them. Returns how many were sent."""
    rows = OutboxMessage.objects.filter(id__in=list(ids), status=OutboxMessage.Status.PENDING)
    return _send_rows(list(rows.filter(due()).order_by("id")))


def outbox_drain_due(limit: int = 50) -> int:
    """The sweep hook: send due emails and webhook deliveries, for at most
    ``DRAIN_BUDGET_SECONDS``. Returns how many were sent."""
    started = time.monotonic()
    rows = list(
        OutboxMessage.objects.filter(status=OutboxMessage.Status.PENDING)
        .filter(due())
        .order_by("id")[:limit]
    )
    sent = _send_rows(rows, started=started)
    return sent + sum(drain(limit=limit) for drain in _drains)


def _send_rows(rows: list[OutboxMessage], *, started: float | None = None) -> int:
    sent = 0
    for row in rows:
        if started is not None and time.monotonic() - started > DRAIN_BUDGET_SECONDS:
            break  # the rest stay due for the next pass
        # rendered before the claim: the claim's time is for the send (rendering reads the
        # database and templates; on a busy machine that can take a good part of a second)
        kind, message = _render(row)
        token = claim(OutboxMessage, row.id, attempts=row.attempts)
        if token:
            sent += _send_rendered(row, token, kind, message)
    return sent


def _render(row: OutboxMessage) -> tuple[Kind | None, EmailMessage | None]:
    kind = _kinds.get(row.kind)
    return kind, kind.render(row) if kind is not None else None


def _send_one(row: OutboxMessage, claim_token: str) -> bool:
    """Render and send one row this drainer claimed."""
    return _send_rendered(row, claim_token, *_render(row))


def _send_rendered(
    row: OutboxMessage, claim_token: str, kind: Kind | None, message: EmailMessage | None
) -> bool:
    if kind is None or message is None:
        if kind is None:
            log.error("outbox message %s: no renderer for kind %r", row.id, row.kind)
        OutboxMessage.objects.filter(id=row.id, claim_token=claim_token).update(
            status=OutboxMessage.Status.CANCELLED, claim_token="", next_attempt_at=None
        )
        return False
    message.extra_headers["Message-ID"] = row.message_id
    message.to = [row.to_address]
    if not still_claimed(OutboxMessage, row.id, claim_token):
        return False  # taken over or sent meanwhile: whoever holds it now sends it
    error = ""
    try:
        # a connection of its own: a server that dropped the previous one must not fail
        # this message too; and a deadline (Django's default is to wait forever)
        with get_connection(timeout=send_timeout()) as connection:
            message.connection = connection
            message.send()
    except Exception as exc:  # smtplib, socket and backend errors alike: retried
        error = f"{type(exc).__name__}: {exc}"
        log.warning("email %s (%s) to %s failed: %s", row.id, row.kind, row.to_address, error)
    if not error:
        # DESIGN §9 contract point: sent, not yet marked (a crash here sends it twice)
        faults.crash_point("notify_sent")
        payload = {k: v for k, v in row.payload.items() if k != "seed"}
        OutboxMessage.objects.filter(id=row.id, status=OutboxMessage.Status.PENDING).update(
            status=OutboxMessage.Status.SENT,
            attempts=row.attempts + 1,
            sent_at=Now(),
            claim_token="",
            next_attempt_at=None,
            last_error="",
            payload=payload,
        )
    else:
        attempt_failed(OutboxMessage, row, claim_token, error, permanent=False)
    if kind.recorded is not None:
        try:
            kind.recorded(row, error)
        except Exception:
            # the message went out (or was retried); its record on the run is secondary
            log.exception("outbox message %s: recording the attempt failed", row.id)
    return not error


def attempt_on_timeline(
    row: OutboxMessage, error: str, *, event_prefix: str, **detail: Any
) -> None:
    """Record one attempt of an email about a run on its timeline, by the system over the
    email channel: ``<prefix>.email_sent``, or ``<prefix>.email_failed`` with the error (it
    is retried). The recipient is named by username, as everywhere on the timeline."""
    from django.contrib.auth import get_user_model

    from runs.record.checkpoint import checkpoint

    if row.run_id is None:
        return
    user = get_user_model().objects.filter(pk=row.recipient_id).first()
    detail["to"] = user.get_username() if user is not None else row.to_address
    if row.attempts:
        detail["attempt"] = row.attempts + 1
    with checkpoint(row.run_id, actor="system", channel="email") as cp:
        if error:
            cp.event(f"{event_prefix}.email_failed", error=error, **detail)
        else:
            cp.event(f"{event_prefix}.email_sent", **detail)


# --- what people see ------------------------------------------------------------------------------


def undeliverable(limit: int = 20) -> list[OutboxMessage]:
    """Emails given up on, newest first (the dashboard)."""
    return list(OutboxMessage.objects.filter(status=OutboxMessage.Status.FAILED)[:limit])
