"""The chained ``AuditEntry`` log of actions outside any run (issue 8, docs/audit.md).

**Audit entries** (``AuditEntry``) are appended by ``audit_record`` only: API tokens created
and revoked, remote agent manifests registered or changed, users' roles and emails changed,
sign-ins, lockouts and unlocks. They form one chain over all entries in id order (the first
anchors to a fixed value). Appends are serialised (a transaction-level advisory lock on
PostgreSQL; SQLite's IMMEDIATE transactions serialise writers already), so the id order is the
chain order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from django.db import connections, router, transaction
from django.utils import timezone

from runs.audit.export import keyset_iterate
from runs.models import AuditEntry, RunEvent
from runs.record.chain import payload_digest

AUDIT_ANCHOR = hashlib.sha256(b"agentops-audit").hexdigest()
# any fixed 64-bit number: the advisory lock every audit append takes on PostgreSQL
_AUDIT_LOCK_KEY = 0x6167656E746F7073  # "agentops"


def entry_payload(before: Any, after: Any) -> dict[str, Any]:
    return {"before": before, "after": after}


def entry_hash(entry: AuditEntry) -> str:
    """Hash over the entry's fields, its payload digest and the previous entry's hash."""
    parts = [
        entry.prev_hash,
        entry.created_at.isoformat(),
        entry.action,
        entry.actor,
        entry.channel,
        entry.ip_address or "",
        entry.user_agent,
        entry.object_type,
        entry.object_id,
        entry.payload_digest,
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def request_ip(request: Any) -> str | None:
    """The client address as the server saw it. ``X-Forwarded-For`` is not trusted: any client
    can send it, and an audit record must not hold an address the client chose."""
    if request is None:
        return None
    address = (getattr(request, "META", {}) or {}).get("REMOTE_ADDR") or None
    if address is None:
        return None
    from django.core.exceptions import ValidationError
    from django.core.validators import validate_ipv46_address

    try:
        validate_ipv46_address(address)
    except ValidationError:
        return None
    return address


def request_user_agent(request: Any) -> str:
    if request is None:
        return ""
    return str((getattr(request, "META", {}) or {}).get("HTTP_USER_AGENT", ""))[:1000]


def audit_record(
    *,
    action: str,
    actor: str,
    channel: str,
    request: Any = None,
    object_type: str = "",
    object_id: Any = "",
    before: Any = None,
    after: Any = None,
) -> AuditEntry:
    """Append one entry to the audit log and return it. The only way entries are written.

    ``action`` is a dotted name (``token.created``, ``agent.registered``, ``user.roles_changed``,
    ``auth.signed_in``, ``auth.locked_out``); ``actor`` a label such as
    ``runs.actors.Actor.label`` (``user:alice``, ``system``); ``channel`` one of the contract
    channels (web, email, api, admin, cli, worker). ``request``, when given, supplies the IP
    address and user agent. ``before``/``after`` are JSON values (reduced to JSON now, so the
    digest hashed is the digest of what an auditor reads back); never put secrets in them.

    Call it inside the transaction of the change it records: the entry commits or rolls back
    with the change. It takes the audit lock until that transaction ends."""
    if channel not in RunEvent.Channel.values:
        raise ValueError(f"channel must be one of {RunEvent.Channel.values}, not {channel!r}")
    if not action or not actor:
        raise ValueError("an audit entry needs an action and an actor")
    payload = json.loads(json.dumps(entry_payload(before, after), default=str))
    alias = router.db_for_write(AuditEntry)
    with transaction.atomic(using=alias):
        connection = connections[alias]
        if connection.vendor == "postgresql":
            # One chain over every entry: appends must not interleave between reading the
            # last hash and inserting. Held until the (outer) transaction commits.
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_AUDIT_LOCK_KEY])
        # on SQLite the IMMEDIATE transaction already holds the database's write lock
        last = AuditEntry.objects.using(alias).order_by("-id").values_list("hash", flat=True)
        prev_hash = last.first() or AUDIT_ANCHOR
        entry = AuditEntry(
            created_at=timezone.now(),
            action=action[:60],
            actor=str(actor)[:200],
            channel=channel,
            ip_address=request_ip(request),
            user_agent=request_user_agent(request),
            object_type=object_type[:60],
            object_id=str(object_id)[:200],
            before=payload["before"],
            after=payload["after"],
            payload_digest=payload_digest(payload),
            prev_hash=prev_hash,
        )
        entry.hash = entry_hash(entry)
        entry.save(using=alias)
    return entry


@dataclass(frozen=True)
class BrokenEntry:
    entry_id: Any
    problem: str

    def __str__(self) -> str:
        return f"audit entry {self.entry_id}: {self.problem}"


@dataclass
class EntryChainResult:
    checked: int = 0
    head: str = AUDIT_ANCHOR
    head_id: Any = None
    broken: BrokenEntry | None = None
    head_found: bool | None = None


def verify_entries(*, expected_head: str | None = None) -> EntryChainResult:
    """Walk the audit entry chain in id order; stop at the first broken link. With
    ``expected_head`` (a hash recorded earlier), also report whether it is still in the chain:
    its absence means entries were cut off the end or rewritten since it was recorded."""
    result = EntryChainResult(head_found=None if expected_head is None else False)
    previous = AUDIT_ANCHOR
    for entry in keyset_iterate(AuditEntry.objects.all(), keys=("id",)):
        if entry.prev_hash != previous:
            result.broken = BrokenEntry(entry.id, "does not link to the entry before it")
            return result
        if entry.payload_digest != payload_digest(entry_payload(entry.before, entry.after)):
            result.broken = BrokenEntry(entry.id, "before/after values do not match the digest")
            return result
        if entry.hash != entry_hash(entry):
            result.broken = BrokenEntry(entry.id, "fields do not match the entry's hash")
            return result
        previous = entry.hash
        result.checked += 1
        result.head, result.head_id = entry.hash, entry.id
        if expected_head is not None and entry.hash == expected_head:
            result.head_found = True
    return result
