"""Webhooks (issue 6): an API token's callback URL hears what its principal's runs need.

Events (``X``: the run event that causes it):

- ``approval.decided`` (``approval.decided``) — a person decided one of the run's approvals;
- ``run.needs_attention`` (``run.needs_attention``) — the run waits for a person;
- ``run.lease_expired`` (``run.lease_expired``) — a remote agent process stopped heartbeating;
- ``run.wait_ended`` (``run.wait_ended``, ``run.wait_timed_out``) — a wait ended: a signal
  arrived, a question was answered, a timer fired or the wait timed out (a remote agent's
  run is then queued: lease it to continue);
- ``run.finished`` (``run.succeeded``, ``run.failed``, ``run.terminated``).

A token receives the events of runs whose principal is the token's principal, and of the
runs of the remote agents its principal owns (the agent role: the process that drives them
learns there when to lease again). Each becomes a
``WebhookDelivery`` row written *inside the transaction that appends the event*
(``runs.record.checkpoint.register_event_listener``): an event that commits always gets its delivery,
a rolled-back one never does. Deliveries are outbox rows (``runs.outbox``, DESIGN §9):
every worker's sweeper sends the due ones (``webhooks_deliver_due``) outside any
transaction — claimed, checked just before the request leaves, marked after — retrying
failures with exponential backoff; every attempt's status code or error is recorded on the
row. ``Agentops-Webhook-Id`` (the delivery id) is the same on every attempt: a receiver
recognises a delivery sent again after a crash between the send and the mark.

Signing: ``Agentops-Webhook-Signature: v2=<hex HMAC-SHA256(secret, "<delivery id>.<timestamp>."
+ body)>`` with ``Agentops-Webhook-Id`` and ``Agentops-Webhook-Timestamp`` (Unix seconds): a
receiver refuses stale requests and, the id being signed too, deduplicates by it — a request
replayed within the tolerance has an id already seen (``agentops.client.verify_webhook``).
Callback URLs that resolve to a private, loopback, link-local or otherwise reserved address —
also written as an IPv6 form that embeds one (IPv4-mapped, NAT64, 6to4, Teredo) — are refused
unless it lies in ``AGENTOPS["WEBHOOK_ALLOWED_NETWORKS"]``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings
from django.db.models import Q
from django.db.models.functions import Now

from runs import faults, outbox
from runs.masking import UNMASKED, maskers_for_ids
from runs.models import ApiToken, WebhookDelivery
from runs.record.checkpoint import Checkpoint, register_event_listener
from runs.record.eventtypes import EventType

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "Agentops-Webhook-Signature"
TIMESTAMP_HEADER = "Agentops-Webhook-Timestamp"
EVENT_HEADER = "Agentops-Webhook-Event"
DELIVERY_HEADER = "Agentops-Webhook-Id"

# run event type -> webhook event type
EVENT_TYPES: dict[str, str] = {
    EventType.APPROVAL_DECIDED: "approval.decided",
    EventType.RUN_NEEDS_ATTENTION: "run.needs_attention",
    EventType.RUN_LEASE_EXPIRED: "run.lease_expired",
    EventType.RUN_WAIT_ENDED: "run.wait_ended",
    EventType.RUN_WAIT_TIMED_OUT: "run.wait_ended",
    EventType.RUN_SUCCEEDED: "run.finished",
    EventType.RUN_FAILED: "run.finished",
    EventType.RUN_TERMINATED: "run.finished",
}
WEBHOOK_EVENTS = (
    "approval.decided",
    "run.needs_attention",
    "run.lease_expired",
    "run.wait_ended",
    "run.finished",
)


def _conf(name: str, default: Any) -> Any:
    return settings.AGENTOPS.get(name, default)


def _live_tokens(principal_id: Any, *, agent_name: str | None = None):
    hears = Q(principal_id=principal_id) if principal_id is not None else Q(pk__in=[])
    if agent_name is not None:
        hears |= Q(principal__owned_agents__name=agent_name)
    return (
        ApiToken.objects.filter(hears, revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=Now()))
        .exclude(webhook_url="")
    )


def enqueue_for_checkpoint(cp: Checkpoint) -> None:
    """The event listener: inside the checkpoint's transaction, one delivery per matching
    event per subscribed token."""
    matching = [event for event in cp.events if event.type in EVENT_TYPES]
    if not matching:
        return
    token_ids = list(
        _live_tokens(cp.run.principal_id, agent_name=cp.run.agent_name)
        .values_list("id", flat=True)
        .distinct()
    )
    if not token_ids:
        return
    status = cp.updates.get("status", cp.run.status)
    if not isinstance(status, str):
        status = cp.run.status
    rows = []
    for event in matching:
        body = {
            "type": EVENT_TYPES[event.type],
            "run": {"id": str(cp.run.id), "agent": cp.run.agent_name, "status": status},
            "event": {
                "seq": event.seq,
                "type": event.type,
                "created_at": event.created_at.isoformat(),
                "actor": event.actor,
                "payload": event.payload,
            },
        }
        rows += [
            WebhookDelivery(
                token_id=token_id, run_id=cp.run.id, event_type=body["type"], payload=body
            )
            for token_id in token_ids
        ]
    WebhookDelivery.objects.bulk_create(rows)
    outbox.enqueued_on_commit()


def enqueue_for_alert(alert: Any) -> None:
    """``runs.alerts`` listener: alerts that are not about one run's events (a worker stopped,
    no live worker) go to admins' tokens as ``alert.raised``; a run needing attention is
    already sent as ``run.needs_attention`` with its event."""
    if alert.kind == "run_needs_attention":
        return
    from django.contrib.auth import get_user_model

    admins = get_user_model().objects.filter(
        Q(is_superuser=True) | Q(groups__name="admin"), is_active=True
    )
    tokens = (
        ApiToken.objects.filter(principal__in=admins, revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=Now()))
        .exclude(webhook_url="")
        .distinct()
    )
    body = {
        "type": "alert.raised",
        "alert": {
            "kind": alert.kind,
            "cause": alert.cause,
            "worker": alert.worker_name,
            "detail": alert.detail,
            "created_at": alert.created_at.isoformat() if alert.created_at else None,
        },
    }
    if WebhookDelivery.objects.bulk_create(
        WebhookDelivery(token=token, event_type="alert.raised", payload=body) for token in tokens
    ):
        outbox.enqueued_on_commit()


def install() -> None:
    """Called from ``RunsConfig.ready``."""

    # sent by the outbox's sweep hook (runs.outbox.outbox_drain_due)
    register_event_listener(enqueue_for_checkpoint, EVENT_TYPES)
    outbox.register_drain(webhooks_deliver_due)
    try:
        from runs import alerts
    except ImportError:  # pragma: no cover - alerts are optional to this module
        return
    if enqueue_for_alert not in alerts.ALERT_LISTENERS:
        alerts.ALERT_LISTENERS.append(enqueue_for_alert)


# --- signing ------------------------------------------------------------------------------------


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """v2 covers the delivery id (v1 did not: a replay could not be told from a new delivery
    by an id the sender vouched for) and the timestamp, each ended by a dot."""
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    return "v2=" + hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def encode(payload: Any) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()


# --- where we may send ----------------------------------------------------------------------------


def url_refusal(url: str) -> str:
    """Why this callback URL may not be called (empty when it may)."""
    return checked_address(url)[0]


def checked_address(url: str) -> tuple[str, str]:
    """(why the URL may not be called, or ""; the address to connect to). Every address the
    host resolves to must be public, or inside ``AGENTOPS["WEBHOOK_ALLOWED_NETWORKS"]``: a
    webhook must not become a way to reach internal services. Checked when a delivery is
    sent (addresses change), and the delivery then connects to the address checked here —
    never to what a second lookup answers (DNS rebinding: a name that resolves to a public
    address for the check and to an internal one for the connection)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "the callback URL must be http(s) with a host", ""
    allowed = [
        ipaddress.ip_network(net, strict=False) for net in _conf("WEBHOOK_ALLOWED_NETWORKS", [])
    ]
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 443, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        return f"cannot resolve {parts.hostname}: {exc}", ""
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for address in addresses:
        if not _may_connect(address, allowed):
            return f"{parts.hostname} resolves to {address}, a non-public address", ""
    if not addresses:
        return f"cannot resolve {parts.hostname}: no address", ""
    return "", str(addresses[0])


# IPv6 forms that carry an IPv4 address a gateway or the host's own stack then reaches: judged
# by the IPv4 address inside (Python counts 64:ff9b::10.0.0.1 and 2002:0a00:0001:: as global)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# RFC 8215 local-use NAT64: how it embeds an address is the operator's choice; never public
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
# deprecated IPv4-compatible addresses (::10.0.0.1); also covers :: and ::1
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]  # the client's address
    if address in _NAT64 or address in _IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _may_connect(address: Any, allowed: list[Any]) -> bool:
    if any(address.version == net.version and address in net for net in allowed):
        return True
    if address.version == 6:
        if address in _NAT64_LOCAL:
            return False
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            if not _may_connect(embedded, allowed):
                return False
            if address.ipv4_mapped is not None:
                return True  # the host's own stack connects to the IPv4 address itself
    # a tunnel or translator prefix must itself be public too (Teredo's is not)
    return address.is_global and not address.is_multicast


def _pinned_request(url: str, address: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The URL with its host replaced by ``address``, the Host header the receiver expects,
    and, for https, the name the TLS handshake sends and the certificate is checked against."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + host
    if parts.port:
        netloc += f":{parts.port}"
    pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    headers = {"Host": parts.netloc.rpartition("@")[2]}
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return pinned, headers, extensions


# --- delivering ----------------------------------------------------------------------------------


def _backoff(attempts: int) -> float:
    base = float(_conf("WEBHOOK_BACKOFF", 5.0))
    return min(base * (2 ** max(attempts - 1, 0)), 3600.0)


def _shown(delivery: WebhookDelivery) -> Any:
    """What leaves: the payload with the run's sensitive tool output masked (runs.masking).
    Masked when sent, not when enqueued: the enqueue runs inside the engine's checkpoint,
    which may not query; a copy that leaves the system is masked for everyone."""
    if delivery.run_id is None:
        return delivery.payload
    masks = maskers_for_ids([delivery.run_id])
    return masks.get(delivery.run_id, UNMASKED)(delivery.payload)


def deliver(delivery: WebhookDelivery, claim_token: str) -> bool:
    """Send one delivery this process claimed (no transaction is open) and record the
    attempt."""
    token = delivery.token
    error, status_code, address = "", None, ""
    if not token.webhook_url or token.revoked_at is not None:
        error = "the token no longer has a callback URL"
    elif not token.webhook_secret:
        error = "the token has no webhook secret to sign with"
    else:
        error, address = checked_address(token.webhook_url)
    permanent = bool(error)
    if not error:
        body = encode(_shown(delivery))
        timestamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "agentops-webhooks/1",
            DELIVERY_HEADER: str(delivery.id),
            EVENT_HEADER: delivery.event_type,
            TIMESTAMP_HEADER: timestamp,
            SIGNATURE_HEADER: sign(token.webhook_secret, str(delivery.id), timestamp, body),
        }
        # imported here: every process loads this module (its checkpoint listener), only
        # the delivering worker needs an HTTP client (worker start-up time, docs/benchmarks.md)
        import httpx

        url, host_header, extensions = _pinned_request(token.webhook_url, address)
        if not outbox.still_claimed(WebhookDelivery, delivery.id, claim_token):
            return False  # taken over or delivered meanwhile (this process was frozen)
        try:
            with httpx.Client(timeout=outbox.send_timeout(), follow_redirects=False) as client:
                request = client.build_request(
                    "POST",
                    url,
                    content=body,
                    headers={**headers, **host_header},
                    extensions=extensions,
                )
                response = client.send(request)
            status_code = response.status_code
            if not 200 <= status_code < 300:
                error = f"answered {status_code}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"[:2000]
    attempts = delivery.attempts + 1
    if not error:
        # DESIGN §9 contract point: delivered, not yet marked (a crash here sends it twice,
        # with the same delivery id)
        faults.crash_point("notify_sent")
        # not fenced: a delivery that happened is a fact, whoever holds the claim now
        WebhookDelivery.objects.filter(
            id=delivery.id, status=WebhookDelivery.Status.PENDING
        ).update(
            status=WebhookDelivery.Status.DELIVERED,
            attempts=attempts,
            last_status_code=status_code,
            last_error="",
            delivered_at=Now(),
            next_attempt_at=None,
            claim_token="",
        )
        return True
    give_up = permanent or attempts >= int(_conf("WEBHOOK_MAX_ATTEMPTS", 8))
    # only the claim's holder records a failure (a taken-over claim's attempt is history)
    WebhookDelivery.objects.filter(
        id=delivery.id, status=WebhookDelivery.Status.PENDING, claim_token=claim_token
    ).update(
        status=WebhookDelivery.Status.FAILED if give_up else WebhookDelivery.Status.PENDING,
        attempts=attempts,
        last_status_code=status_code,
        last_error=error,
        next_attempt_at=None if give_up else Now() + timedelta(seconds=_backoff(attempts)),
        claim_token="",
    )
    log.info("webhook delivery %s attempt %s failed: %s", delivery.id, attempts, error)
    return False


def webhooks_deliver_due(limit: int = 50) -> int:
    """The sweep hook: send every due delivery once. Returns how many were delivered."""
    due = list(
        WebhookDelivery.objects.filter(status=WebhookDelivery.Status.PENDING)
        .filter(Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=Now()))
        .select_related("token")
        .order_by("id")[:limit]
    )
    delivered = 0
    for delivery in due:
        claim_token = outbox.claim(WebhookDelivery, delivery.id, attempts=delivery.attempts)
        if claim_token:
            delivered += deliver(delivery, claim_token)
    return delivered
