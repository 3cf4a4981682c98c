"""Pinned heads: what an emptied or rewound table cannot hide (``audit_verify --write-head``,
``--expect-head``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import QuerySet, Sum
from django.utils import timezone

from runs.models import ArchivedChain, AuditEntry, RunEvent

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
        # events ``retention`` dropped after the head was recorded were counted by it
        since = _dropped_since(pinned) if model is RunEvent else None
        dropped = _dropped_events(since, last_id) if since is not None else 0
        if stored is None and since is not None and _was_dropped(since, part):
            pass  # exported by ``retention``, then dropped: the export holds it
        elif stored is None:
            problems.append(
                f"{label}: the newest one when the head was recorded (id {last_id}) is gone "
                f"(the table was emptied or rewound)"
            )
        elif stored != last_hash:
            problems.append(f"{label}: id {last_id} no longer has the recorded hash")
        now = model.objects.filter(id__lte=last_id).count()
        if dropped is None:
            problems.append(
                f"{label}: events dropped by retention since were still being written when the "
                "head was recorded: their count up to it is unknown (check the exports, then "
                "write a new head)"
            )
            continue
        now += dropped
        if now != count:
            problems.append(
                f"{label}: {count} existed up to id {last_id} when the head was recorded, "
                f"{now} do now"
            )
    return problems


def _dropped_since(pinned: dict[str, Any]) -> QuerySet:
    """The runs whose events were dropped after the head was recorded."""
    try:
        recorded_at = datetime.fromisoformat(str(pinned.get("recorded_at")))
    except ValueError:
        raise ValueError("audit head: recorded_at is not a time") from None
    return ArchivedChain.objects.filter(dropped_at__gt=recorded_at)


def _dropped_events(dropped: QuerySet, last_id: int) -> int | None:
    """How many events up to id ``last_id`` are among ``dropped`` runs' (the head counted
    them); None when a dropped run's events straddle that id (which of them came before it
    is known only to the export)."""
    if dropped.filter(first_event_id__lte=last_id, last_event_id__gt=last_id).exists():
        return None
    total = dropped.filter(last_event_id__lte=last_id).aggregate(n=Sum("events"))["n"]
    return total or 0


def _was_dropped(dropped: QuerySet, part: dict[str, Any]) -> bool:
    """Whether the newest event of a head is among the ``dropped`` runs' exported events."""
    run_id, seq = part.get("last_run_id"), part.get("last_seq")
    if run_id is None or not isinstance(seq, int):
        return False
    return dropped.filter(run_id=run_id, seq__gte=seq).exists()
