"""The audit record: verifying the run event chains, and the chained ``AuditEntry`` log of
actions outside any run (issue 8).

**Run events** (``RunEvent``) are written by ``runs.record.checkpoint.checkpoint`` only. Verification
proves every stored event still hashes to its stored hash over its own fields and its payload
digest, each links to the event before it (the first to the run's id), sequence numbers have
no gap, and the run's recorded head (``event_seq``, ``last_event_hash``) matches the last
event. So an edited, deleted, inserted or reordered event is detected.

**Audit entries** (``AuditEntry``) are appended by ``audit_record`` only: API tokens created
and revoked, remote agent manifests registered or changed, users' roles and emails changed,
sign-ins, lockouts and unlocks. They form one chain over all entries in id order (the first
anchors to a fixed value). Appends are serialised (a transaction-level advisory lock on
PostgreSQL; SQLite's IMMEDIATE transactions serialise writers already), so the id order is the
chain order.

What verification does not prove: that a chain was not recomputed wholesale by someone with
write access to the database and this code (the hashes are not signed with a secret), that the
newest audit entries or events were not cut off the end or the tables emptied (nothing after
them links back; compare with a head recorded elsewhere: ``audit_verify --expect-head``),
nor that the record describes what really happened outside the database.
"""

from __future__ import annotations

import contextvars
import csv
import hashlib
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connections, router, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from runs.models import AuditEntry, Run, RunEvent
from runs.record.chain import anchor_hash, event_hash, payload_digest
from runs.record.eventtypes import EventType

# --- run event chains -------------------------------------------------------------------------


@dataclass(frozen=True)
class BrokenLink:
    run_id: Any
    seq: int
    problem: str

    def __str__(self) -> str:
        return f"run {self.run_id} event {self.seq}: {self.problem}"


def verify_run(run: Run) -> BrokenLink | None:
    """The first broken link of one run's chain, or None when it is intact.

    ``prune`` empties steps, tool calls, receipts and run state but never an event: events keep
    their payloads, so every payload digest is recomputed here, pruned run or not."""
    previous = anchor_hash(run.id)
    expected_seq = 0
    events = RunEvent.objects.filter(run_id=run.id).order_by("seq").iterator(chunk_size=2000)
    for event in events:
        expected_seq += 1
        if event.seq != expected_seq:
            return BrokenLink(run.id, expected_seq, f"missing (next stored event is {event.seq})")
        if event.prev_hash != previous:
            return BrokenLink(run.id, event.seq, "does not link to the event before it")
        if event.payload_digest != payload_digest(event.payload):
            return BrokenLink(run.id, event.seq, "payload does not match its digest")
        if event.hash != event_hash(event):
            return BrokenLink(run.id, event.seq, "fields do not match the event's hash")
        previous = event.hash
    if run.event_seq != expected_seq:
        return BrokenLink(
            run.id, expected_seq + 1, f"run records {run.event_seq} events, {expected_seq} stored"
        )
    if expected_seq and run.last_event_hash != previous:
        return BrokenLink(run.id, expected_seq, "run's head hash does not match the last event")
    return None


def verify_all(run_ids: list[Any] | None = None) -> Iterator[tuple[Run, BrokenLink | None]]:
    runs = Run.objects.order_by("created_at", "id").only("id", "event_seq", "last_event_hash")
    if run_ids is not None:
        runs = runs.filter(id__in=run_ids)
    for run in runs.iterator(chunk_size=500):
        yield run, verify_run(run)


# --- the audit entry chain --------------------------------------------------------------------

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


# --- pinned heads: what an emptied or rewound table cannot hide -------------------------------
# A chain proves nothing about rows that are gone from its end: an emptied table is an intact,
# empty chain. A head recorded earlier and kept outside the database (``audit_verify
# --write-head``) names the newest audit entry and event then, and how many there were; every
# one of them must still be there, unchanged (``audit_verify --expect-head``).

HEAD_FORMAT = "agentops-audit-head/1"


def chain_head() -> dict[str, Any]:
    """The newest audit entry and event, and how many of each exist, as JSON values."""
    audit = AuditEntry.objects.order_by("-id").values("id", "hash").first()
    event = RunEvent.objects.order_by("-id").values("id", "run_id", "seq", "hash").first()
    return {
        "format": HEAD_FORMAT,
        "recorded_at": timezone.now().isoformat(),
        "audit_entries": {
            "count": AuditEntry.objects.count(),
            "last_id": audit["id"] if audit else None,
            "last_hash": audit["hash"] if audit else None,
        },
        "events": {
            "count": RunEvent.objects.count(),
            "last_id": event["id"] if event else None,
            "last_run_id": str(event["run_id"]) if event else None,
            "last_seq": event["seq"] if event else None,
            "last_hash": event["hash"] if event else None,
        },
    }


def head_problems(pinned: dict[str, Any]) -> list[str]:
    """What no longer matches a head recorded earlier: its newest rows gone or changed, or
    fewer rows up to them than there were (rows appended since are fine)."""
    if not isinstance(pinned, dict) or pinned.get("format") != HEAD_FORMAT:
        raise ValueError(f"not an audit head (expected format {HEAD_FORMAT!r})")
    problems = []
    for label, model, key in (
        ("audit entries", AuditEntry, "audit_entries"),
        ("events", RunEvent, "events"),
    ):
        part = pinned.get(key) or {}
        count, last_id, last_hash = part.get("count"), part.get("last_id"), part.get("last_hash")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"audit head: {key}.count is not a count")
        if last_id is None:
            continue  # nothing was recorded then
        stored = model.objects.filter(id=last_id).values_list("hash", flat=True).first()
        if stored is None:
            problems.append(
                f"{label}: the newest one when the head was recorded (id {last_id}) is gone "
                f"(the table was emptied or rewound)"
            )
        elif stored != last_hash:
            problems.append(f"{label}: id {last_id} no longer has the recorded hash")
        now = model.objects.filter(id__lte=last_id).count()
        if now != count:
            problems.append(
                f"{label}: {count} existed up to id {last_id} when the head was recorded, "
                f"{now} do now"
            )
    return problems


# --- streaming exports ------------------------------------------------------------------------

EXPORT_CHUNK_SIZE = 2000


def keyset_iterate(
    queryset: QuerySet, *, keys: tuple[str, ...] = ("id",), chunk_size: int = 0
) -> Iterator[Any]:
    """Every row of ``queryset`` in ``keys`` order, fetched ``chunk_size`` rows per query.

    Keyset pagination (``WHERE id > last seen ORDER BY id LIMIT n``) rather than a server-side
    cursor: memory stays constant whatever the range, each query is short (no transaction or
    snapshot held open for the length of a download), and it works the same on SQLite and
    behind a transaction-pooling proxy where named cursors do not. The primary key is the
    default key: ids are allocated in the order rows were written (for audit entries, the
    chain's order), and its index serves every chunk, whatever else the filter says."""
    chunk_size = chunk_size or EXPORT_CHUNK_SIZE
    queryset = queryset.order_by(*keys)
    last: tuple[Any, ...] | None = None
    while True:
        page = queryset
        if last is not None:
            page = page.filter(_after(keys, last))
        rows = list(page[:chunk_size])
        yield from rows
        if len(rows) < chunk_size:
            return
        last = tuple(_key(rows[-1], key) for key in keys)


def _key(row: Any, key: str) -> Any:
    # model instances, or dicts from ``.values()`` (several times faster for big exports)
    return row[key] if isinstance(row, dict) else getattr(row, key)


def _after(keys: tuple[str, ...], last: tuple[Any, ...]) -> Q:
    # (a, b) > (x, y)  ==  a > x OR (a = x AND b > y)
    condition = Q(**{f"{keys[-1]}__gt": last[-1]})
    for index in range(len(keys) - 2, -1, -1):
        condition = Q(**{f"{keys[index]}__gt": last[index]}) | (
            Q(**{keys[index]: last[index]}) & condition
        )
    return condition


EVENT_COLUMNS = [
    "run_id",
    "seq",
    "created_at",
    "type",
    "actor",
    "channel",
    "incarnation",
    "trace_id",
    "span_id",
    "payload",
    "payload_digest",
    "prev_hash",
    "hash",
    # whether the event's run is a dry run (issue 23): its tools were only simulated. Not
    # part of the chain (the run's run.created event records it, and is chained)
    "dry_run",
]


EVENT_FIELDS = ["id", *EVENT_COLUMNS[:-1]]


def event_row(event: dict[str, Any]) -> dict[str, Any]:
    """One exported event from a ``.values(*EVENT_FIELDS)`` row."""
    row = {column: event[column] for column in EVENT_COLUMNS}
    row["run_id"] = str(row["run_id"])
    row["created_at"] = row["created_at"].isoformat()
    return row


def events_for_export(
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    run_id: Any = None,
    types: Iterable[str] = (),
) -> QuerySet:
    """Events with ``since <= created_at < until`` (either bound optional), optionally of one
    run and some types, as ``.values()`` rows for ``event_row``. Payloads were masked at
    write time, so an export holds no secret."""
    events = RunEvent.objects.all()
    if since is not None:
        events = events.filter(created_at__gte=since)
    if until is not None:
        events = events.filter(created_at__lt=until)
    if run_id is not None:
        events = events.filter(run_id=run_id)
    types = list(types)
    if types:
        events = events.filter(type__in=types)
    return events.values(*EVENT_FIELDS, dry_run=F("run__dry_run"))


class _Echo:
    """A file-like object whose write() returns the line: csv.writer then yields strings."""

    def write(self, value: str) -> str:
        return value


def csv_lines(columns: list[str], rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(columns)
    for row in rows:
        yield writer.writerow([_cell(row[column]) for column in columns])


def jsonl_lines(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    for row in rows:
        yield json.dumps(row, sort_keys=True, default=str) + "\n"


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, default=str)
    text = str(value)
    # a spreadsheet would run a cell starting with these as a formula (CSV injection)
    if text[:1] in ("=", "+", "-", "@", "\t", "\r") and not _is_number(text):
        return "'" + text
    return text


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# --- sign-ins ---------------------------------------------------------------------------------
# Django's user_logged_in / user_login_failed signals are the only hook it offers for every
# way a person signs in (the admin's login page, the console's, a test client's login). They
# are connected in ``RunsConfig.ready``.


def _sign_in_channel(request: Any) -> str:
    from django.urls import NoReverseMatch, reverse

    path = getattr(request, "path", "") or ""
    try:
        admin_prefix = reverse("admin:index")
    except NoReverseMatch:
        return "web"
    return "admin" if path.startswith(admin_prefix) else "web"


def on_user_logged_in(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    audit_record(
        action="auth.signed_in",
        actor=f"user:{user.get_username()}",
        channel=_sign_in_channel(request),
        request=request,
        object_type="user",
        object_id=user.pk,
        after={"username": user.get_username(), "path": getattr(request, "path", "") or ""},
    )


# Failed sign-ins are not audit entries: one per failure, under the audit log's global lock,
# let anyone slow every audited action down and fill the log by typing wrong passwords.
# django-axes counts them (per username and address, in its own table, without that lock);
# the audit log records what a person acts on: the lockout, and who lifted it.


def sign_in_client_address(request: Any) -> str | None:
    """The address django-axes counts failures under (``AXES_CLIENT_IP_CALLABLE``): the
    connection's, like ``request_ip``, but an IPv6 address as its /64 — one subscriber
    usually holds a whole /64 and could otherwise try each username from endless addresses."""
    import ipaddress

    address = request_ip(request)
    if address is None:
        return None
    parsed = ipaddress.ip_address(address)
    if parsed.version == 6:
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False).network_address)
    return address


def on_user_locked_out(sender: Any, request: Any, username: Any, ip_address: Any, **kwargs):
    """django-axes's ``user_locked_out``: sent for the failure that reaches the limit and for
    every failure after it while locked. Only the first is recorded — one entry per lockout,
    however long someone keeps trying."""
    from django.conf import settings

    failures = getattr(request, "axes_failures_since_start", None)
    if failures != settings.AXES_FAILURE_LIMIT:
        return
    audit_record(
        action="auth.locked_out",
        actor="anonymous",
        channel=_sign_in_channel(request),
        request=request,
        object_type="user",
        object_id=str(username or "")[:200],
        after={
            "username": str(username or "")[:150],
            "ip_address": ip_address,
            "failures": failures,
            "locked_for_seconds": int(settings.AXES_COOLOFF_TIME.total_seconds()),
            "path": getattr(request, "path", "") or "",
        },
    )


# who is lifting lockouts in this thread (the admin's action sets it); None: a command
_unlocking: contextvars.ContextVar[tuple[str, str, Any] | None] = contextvars.ContextVar(
    "agentops_unlocking", default=None
)


@contextmanager
def unlocking_as(actor: str, channel: str, request: Any = None) -> Iterator[None]:
    token = _unlocking.set((actor, channel, request))
    try:
        yield
    finally:
        _unlocking.reset(token)


def on_access_attempt_deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    """A deleted django-axes attempt that was still locking someone out is an unlock: the
    admin's delete, ``axes_reset*`` commands. Expired attempts (cleaned up as they are
    passed) and the failures a successful sign-in clears locked nobody: not recorded."""
    from django.conf import settings

    if (instance.failures_since_start or 0) < settings.AXES_FAILURE_LIMIT:
        return
    if instance.attempt_time < timezone.now() - settings.AXES_COOLOFF_TIME:
        return
    actor, channel, request = _unlocking.get() or ("system", "cli", None)
    audit_record(
        action="auth.unlocked",
        actor=actor,
        channel=channel,
        request=request,
        object_type="user",
        object_id=str(instance.username or "")[:200],
        after={
            "username": str(instance.username or "")[:150],
            "ip_address": instance.ip_address,
            "failures": instance.failures_since_start,
        },
    )


def connect_signals() -> None:
    from axes.models import AccessAttempt
    from axes.signals import user_locked_out
    from django.contrib.auth.signals import user_logged_in
    from django.db.models.signals import post_delete

    user_logged_in.connect(on_user_logged_in, dispatch_uid="agentops.audit.signed_in")
    user_locked_out.connect(on_user_locked_out, dispatch_uid="agentops.audit.locked_out")
    post_delete.connect(
        on_access_attempt_deleted, sender=AccessAttempt, dispatch_uid="agentops.audit.unlocked"
    )


# --- users' roles -----------------------------------------------------------------------------


def user_roles_snapshot(user: Any) -> dict[str, Any]:
    """What an auditor needs to see change: the groups (roles) and the flags that grant
    access. Permissions granted to a user directly are part of it too."""
    if user is None or user.pk is None:
        return {}
    return {
        "username": user.get_username(),
        "groups": sorted(user.groups.values_list("name", flat=True)),
        "user_permissions": sorted(
            f"{app}.{codename}"
            for app, codename in user.user_permissions.values_list(
                "content_type__app_label", "codename"
            )
        ),
        "is_active": user.is_active,
        "is_staff": user.is_staff,
        "is_superuser": user.is_superuser,
    }


def group_snapshot(group: Any) -> dict[str, Any]:
    if group is None or group.pk is None:
        return {}
    return {
        "name": group.name,
        "permissions": sorted(
            f"{app}.{codename}"
            for app, codename in group.permissions.values_list(
                "content_type__app_label", "codename"
            )
        ),
    }


# --- retention: pruning old terminal runs -----------------------------------------------------
# ``python manage.py prune`` empties the bulky, possibly personal data of terminal runs past
# the retention period: step input/output, tool-call arguments, receipt results, run state.
# Every event (with its masked payload) and every digest is kept, so the chains still verify,
# and a ``run.pruned`` event records what was emptied, by whom, and where it was archived.

PRUNED_EVENT = EventType.RUN_PRUNED


def prune_candidates(older_than: timedelta) -> QuerySet:
    """Terminal runs that finished more than ``older_than`` ago (database time) and were not
    pruned yet, oldest first."""
    from django.db.models import DateTimeField, Exists, ExpressionWrapper, OuterRef
    from django.db.models.functions import Coalesce, Now

    cutoff = ExpressionWrapper(Now() - older_than, output_field=DateTimeField())
    pruned = RunEvent.objects.filter(run_id=OuterRef("pk"), type=PRUNED_EVENT)
    return (
        Run.objects.filter(status__in=Run.TERMINAL)
        .annotate(ended_at=Coalesce("finished_at", "updated_at"))
        .filter(ended_at__lt=cutoff)
        .exclude(Exists(pruned))
    )


def prune_counts(run_ids: list[Any]) -> dict[str, int]:
    from runs.models import Step, ToolCall, ToolReceipt

    return {
        "runs": len(run_ids),
        "steps": Step.objects.filter(run_id__in=run_ids).count(),
        "tool_calls": ToolCall.objects.filter(run_id__in=run_ids).count(),
        "receipts": ToolReceipt.objects.filter(tool_call__run_id__in=run_ids).count(),
    }


def run_archive_record(run_id: Any) -> dict[str, Any]:
    """Everything prune is about to empty for one run, as one JSON object: the run's state,
    its steps' input/output, its calls' real (unmasked) arguments and its receipts' results.
    The archive therefore holds sensitive values: keep it like a database backup."""
    from runs.models import Step, ToolCall, ToolReceipt

    run = Run.objects.values(
        "id", "agent_name", "agent_version", "status", "reason_code", "state", "state_version"
    ).get(id=run_id)
    steps = Step.objects.filter(run_id=run_id).order_by("seq")
    calls = ToolCall.objects.filter(run_id=run_id).order_by("step__seq")
    receipts = ToolReceipt.objects.filter(tool_call__run_id=run_id).order_by("tool_call__step__seq")
    record = {
        "format": "agentops-prune-archive/1",
        "run": run,
        "steps": list(steps.values("seq", "kind", "status", "input", "output")),
        "tool_calls": list(
            calls.values("idempotency_key", "tool_name", "arguments", "arguments_digest")
        ),
        "receipts": list(
            receipts.values("tool_call__idempotency_key", "outcome", "external_ref", "result")
        ),
    }
    return json.loads(json.dumps(record, default=str))


def run_prune(
    *, run_id: Any, actor: Any, older_than: str, archive: str = "", archive_digest: str = ""
) -> dict[str, int] | None:
    """Empty one terminal run's bulky data and append ``run.pruned``, in one transaction with
    the run row locked. Returns what was emptied, or None when the run was pruned meanwhile
    (another prune) — then nothing is written."""
    from runs.models import Step, ToolCall, ToolReceipt
    from runs.record.checkpoint import checkpoint

    with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        if cp.run.status not in Run.TERMINAL:
            raise ValueError(f"run {run_id} is {cp.run.status}, not terminal: not pruned")
        if RunEvent.objects.filter(run_id=run_id, type=PRUNED_EVENT).exists():
            return None
        counts = {
            "steps": Step.objects.filter(run_id=run_id).update(input={}, output=None),
            "tool_calls": ToolCall.objects.filter(run_id=run_id).update(arguments={}),
            "receipts": ToolReceipt.objects.filter(tool_call__run_id=run_id).update(result=None),
        }
        cp.update(state={})
        cp.event(
            PRUNED_EVENT,
            by=actor.label,
            older_than=older_than,
            emptied=[
                "run.state",
                "step.input",
                "step.output",
                "toolcall.arguments",
                "receipt.result",
            ],
            archive=archive or None,
            archive_digest=archive_digest or None,
            **counts,
        )
    return counts
