"""Retention of the record (docs/audit.md, docs/operations.md): ``prune`` empties the bulky
data of old terminal runs, keeping every event; ``retention`` exports whole months of events
with their chain heads and drops them."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from django.db import connection, transaction
from django.db.models import Exists, F, OuterRef, QuerySet
from django.utils import timezone

from runs.errors import InvalidInput, InvalidState
from runs.models import ArchivedChain, Run, RunEvent
from runs.record.eventtypes import EventType

# ``python manage.py prune`` empties the bulky, possibly personal data of terminal runs past
# the retention period: step input/output, tool-call arguments, receipt results, run state.
# Every event (with its masked payload) and every digest is kept, so the chains still verify,
# and a ``run.pruned`` event records what was emptied, by whom, and where it was archived.

PRUNED_EVENT = EventType.RUN_PRUNED


def prune_candidates(older_than: timedelta) -> QuerySet:
    """Terminal runs that finished more than ``older_than`` ago (database time) and were not
    pruned yet, oldest first."""
    from django.db.models import DateTimeField, ExpressionWrapper
    from django.db.models.functions import Coalesce, Now

    cutoff = ExpressionWrapper(Now() - older_than, output_field=DateTimeField())
    pruned = RunEvent.objects.filter(run_id=OuterRef("pk"), type=PRUNED_EVENT)
    # an archived run was pruned before (``archive_month``); its run.pruned event may be
    # dropped from the table since
    archived = ArchivedChain.objects.filter(run_id=OuterRef("pk"))
    return (
        Run.objects.filter(status__in=Run.TERMINAL)
        .annotate(ended_at=Coalesce("finished_at", "updated_at"))
        .filter(ended_at__lt=cutoff)
        .exclude(Exists(pruned))
        .exclude(Exists(archived))
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


# --- retention of events: whole months, exported with their chain heads -------------------------
# Events are never edited; retention removes whole chains. A month (the runs created in it,
# UTC) goes only when every one of its runs is terminal and pruned. Its events are verified,
# then exported as JSON lines with a heads file (per run: the last event's seq and hash, how
# many events, their id range; the events file's SHA-256), synced to disk, and only then
# recorded as archived (``ArchivedChain``, one audit entry). Dropping them (PostgreSQL, as the
# tables' owner) is a separate step: the month's partition of the events is detached and
# dropped (``runs.audit.partitions``); no row is deleted. The run rows stay, with their heads (``event_seq``,
# ``last_event_hash``): an event written later links to the archived head, and
# ``audit_verify`` checks that the stored chain starts where the export ended.

ARCHIVE_FORMAT = "agentops-event-archive/1"
# runs per query (an id list stays well inside SQLite's limit on parameters)
EXPORT_RUNS = 500


@dataclass(frozen=True)
class MonthState:
    month: date
    runs: int
    not_terminal: int
    not_pruned: int
    to_archive: int
    archived: int
    to_drop: int

    @property
    def label(self) -> str:
        return self.month.strftime("%Y-%m")

    @property
    def archivable(self) -> bool:
        return self.to_archive > 0 and not self.not_terminal and not self.not_pruned


def parse_month(value: str) -> date:
    match = re.fullmatch(r"\s*(\d{4})-(\d{2})\s*", value or "")
    if not match or not 1 <= int(match.group(2)) <= 12:
        raise InvalidInput(f"{value!r} is not a month: use YYYY-MM, e.g. 2026-01")
    return date(int(match.group(1)), int(match.group(2)), 1)


def _bounds(month: date) -> tuple[datetime, datetime]:
    start = datetime(month.year, month.month, 1, tzinfo=UTC)
    following = date(month.year + month.month // 12, month.month % 12 + 1, 1)
    return start, datetime(following.year, following.month, 1, tzinfo=UTC)


def _month_runs(month: date) -> QuerySet:
    start, end = _bounds(month)
    return Run.objects.filter(created_at__gte=start, created_at__lt=end)


def month_state(month: date) -> MonthState:
    """What stands in the way of archiving or dropping ``month``'s events."""
    runs = _month_runs(month)
    archived = ArchivedChain.objects.filter(run_id=OuterRef("pk"))
    pruned = RunEvent.objects.filter(run_id=OuterRef("pk"), type=PRUNED_EVENT)
    to_archive = runs.exclude(Exists(archived))
    return MonthState(
        month=month,
        runs=runs.count(),
        not_terminal=runs.exclude(status__in=Run.TERMINAL).count(),
        not_pruned=to_archive.filter(status__in=Run.TERMINAL).exclude(Exists(pruned)).count(),
        to_archive=to_archive.count(),
        archived=ArchivedChain.objects.filter(month=month).count(),
        to_drop=ArchivedChain.objects.filter(month=month, dropped_at__isnull=True).count(),
    )


def month_states(before: date) -> list[MonthState]:
    """Every month before ``before`` (UTC) that holds runs whose events are still stored,
    oldest first."""
    start, _end = _bounds(before)
    not_dropped = Run.objects.filter(created_at__lt=start).exclude(
        Exists(ArchivedChain.objects.filter(run_id=OuterRef("pk"), dropped_at__isnull=False))
    )
    first = not_dropped.order_by("created_at").values_list("created_at", flat=True).first()
    if first is None:
        return []
    first = first.astimezone(UTC)
    month, states = date(first.year, first.month, 1), []
    while month < before:
        state = month_state(month)
        if state.runs:
            states.append(state)
        month = _bounds(month)[1].date()
    return states


def _sync_directory(path: Path) -> None:
    # the new files' names are durable only once their directory is synced
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def archive_month(month: date, directory: Path, *, actor: Any) -> dict[str, Any]:
    """Verify, export and record as archived the events of every run created in ``month``
    not archived yet. Refused unless all of the month's runs are terminal and pruned, and
    when a chain is broken (its evidence must not be exported as good and then dropped).
    Returns what the audit entry records."""
    from runs.audit.entries import audit_record
    from runs.audit.export import EVENT_FIELDS, event_row, keyset_iterate
    from runs.audit.run_chains import verify_all

    label = month.strftime("%Y-%m")
    state = month_state(month)
    if not state.to_archive:
        raise InvalidState(f"{label}: no run left to archive")
    if state.not_terminal or state.not_pruned:
        raise InvalidState(
            f"{label}: not archived: {state.not_terminal} run(s) not terminal, "
            f"{state.not_pruned} not pruned (run prune first)"
        )
    runs = _month_runs(month).exclude(Exists(ArchivedChain.objects.filter(run_id=OuterRef("pk"))))
    run_ids = list(runs.order_by("created_at", "id").values_list("id", flat=True))
    for start in range(0, len(run_ids), EXPORT_RUNS):
        for _run, broken in verify_all(run_ids[start : start + EXPORT_RUNS], full=True):
            if broken is not None:
                raise InvalidState(f"{label}: not archived: broken chain: {broken}")
    stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
    events_path = directory / f"agentops-events-{label}-{stamp}.jsonl"
    heads_path = directory / f"agentops-events-{label}-{stamp}.heads.json"
    heads: dict[Any, dict[str, Any]] = {}
    digest = hashlib.sha256()
    total = 0
    with events_path.open("x", encoding="utf-8") as file:
        for start in range(0, len(run_ids), EXPORT_RUNS):
            chunk = run_ids[start : start + EXPORT_RUNS]
            rows = RunEvent.objects.filter(run_id__in=chunk).values(
                *EVENT_FIELDS, dry_run=F("run__dry_run")
            )
            for row in keyset_iterate(rows, keys=("run_id", "seq")):
                line = json.dumps({"id": row["id"], **event_row(row)}, sort_keys=True) + "\n"
                file.write(line)
                digest.update(line.encode())
                total += 1
                head = heads.setdefault(row["run_id"], {"run_id": str(row["run_id"]), "events": 0})
                head["events"] += 1
                head["seq"], head["hash"] = row["seq"], row["hash"]
                head["first_event_id"] = min(head.get("first_event_id", row["id"]), row["id"])
                head["last_event_id"] = max(head.get("last_event_id", row["id"]), row["id"])
        file.flush()
        os.fsync(file.fileno())
    manifest = {
        "format": ARCHIVE_FORMAT,
        "month": label,
        "events_file": events_path.name,
        "events_sha256": digest.hexdigest(),
        "events": total,
        "runs": [heads[run_id] for run_id in run_ids if run_id in heads],
    }
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    with heads_path.open("x", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    _sync_directory(directory)
    heads_digest = hashlib.sha256(text.encode()).hexdigest()
    now = timezone.now()
    summary = {
        "month": label,
        "runs": len(manifest["runs"]),
        "events": total,
        "export": heads_path.name,
        "export_sha256": heads_digest,
        "events_file": events_path.name,
        "events_sha256": manifest["events_sha256"],
        **_who(),
    }
    with transaction.atomic():
        ArchivedChain.objects.bulk_create(
            ArchivedChain(
                run_id=run_id,
                month=month,
                seq=head["seq"],
                hash=head["hash"],
                events=head["events"],
                first_event_id=head["first_event_id"],
                last_event_id=head["last_event_id"],
                export=heads_path.name,
                export_digest=heads_digest,
                archived_at=now,
            )
            for run_id, head in heads.items()
        )
        audit_record(
            action="events.archived",
            actor=actor.label,
            channel=actor.channel,
            object_type="month",
            object_id=label,
            after=summary,
        )
    return summary


def drop_month(month: date, *, actor: Any) -> dict[str, Any]:
    """Drop the archived events of ``month`` (PostgreSQL, as the tables' owner): its
    partition detached and dropped — no row deleted, no chain rewritten, the space back at
    once. One transaction: the checks, the DETACH and DROP, the runs marked dropped, an audit
    entry. Refused unless every event stored in the partition was exported and every
    exported event of the month is in it."""
    from runs.audit import partitions
    from runs.audit.entries import audit_record

    label = month.strftime("%Y-%m")
    if not partitions.partitioned():
        raise InvalidState(
            "dropping events is for PostgreSQL; on SQLite keep them (prune empties the rest)"
        )
    partitions.require_owner("drop events")
    quote = connection.ops.quote_name
    events, archived = quote(RunEvent._meta.db_table), quote(ArchivedChain._meta.db_table)
    with transaction.atomic(), connection.cursor() as cursor:
        # ALTER TABLE refuses a table with foreign-key checks still pending in this
        # transaction; a lock the engine holds for long is not waited for (retry later)
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute("SET LOCAL lock_timeout = '10s'")
        # the month in a partition of its own, taken out of DEFAULT if its events are there
        name = partitions.ensure_partition(month)
        # nothing is appended to the month's runs (all terminal) until this commits
        cursor.execute(f"LOCK TABLE {quote(name)} IN SHARE MODE")
        cursor.execute(
            f"SELECT count(*), count(*) FILTER (WHERE a.run_id IS NULL OR e.seq > a.seq) "
            f"FROM {quote(name)} e LEFT JOIN {archived} a ON a.run_id = e.run_id "
            "AND a.month = %s AND a.dropped_at IS NULL",
            [month],
        )
        stored, not_exported = cursor.fetchone()
        cursor.execute(
            f"SELECT count(*), coalesce(sum(events), 0) FROM {archived} "
            "WHERE month = %s AND dropped_at IS NULL",
            [month],
        )
        runs, exported = cursor.fetchone()
        if not runs:
            raise InvalidState(f"{label}: nothing archived is left to drop")
        if not_exported:
            raise InvalidState(
                f"{label}: not dropped: {not_exported} stored event(s) of the month were not "
                "exported (written after the archive, or of a run not archived)"
            )
        if stored != exported:
            raise InvalidState(
                f"{label}: not dropped: {exported} event(s) were exported, {name} holds {stored}"
            )
        # not CONCURRENTLY: PostgreSQL refuses that while a DEFAULT partition exists; this
        # DETACH holds the events' lock for a change of the catalogue only
        cursor.execute(f"ALTER TABLE {events} DETACH PARTITION {quote(name)}")
        cursor.execute(f"DROP TABLE {quote(name)}")
        count = ArchivedChain.objects.filter(month=month, dropped_at__isnull=True).update(
            dropped_at=timezone.now()
        )
        summary = {"month": label, "runs": count, "events": stored, "partition": name, **_who()}
        audit_record(
            action="events.dropped",
            actor=actor.label,
            channel=actor.channel,
            object_type="month",
            object_id=label,
            after=summary,
        )
    return summary


def _who() -> dict[str, Any]:
    """Who ran it, as far as the process can tell: the operating system's user and the
    database role (retention is run by a person, as a role the application does not hold)."""
    import getpass

    try:
        os_user = getpass.getuser()
    except (KeyError, OSError):
        os_user = ""
    role = ""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_user")
            role = cursor.fetchone()[0]
    return {"os_user": os_user, "db_role": role}


def verify_export(heads_path: Path) -> dict[str, int]:
    """Check an export ``archive_month`` wrote against itself and the database: the heads
    file is the one recorded for its runs, the events file the one it names; every run's
    exported chain links from its anchor to the recorded head. With ``audit_verify`` (the
    stored chain starts at that head) the whole chain is proven, the dropped part included.
    Raises ``InvalidState`` naming the first problem."""
    from types import SimpleNamespace

    from runs.record.chain import anchor_hash, event_hash, payload_digest

    try:
        text = heads_path.read_text(encoding="utf-8")
        manifest = json.loads(text)
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"cannot read {heads_path}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT:
        raise InvalidInput(f"{heads_path} is not an event archive's heads file")
    digest = hashlib.sha256(text.encode()).hexdigest()
    heads = {head["run_id"]: head for head in manifest["runs"]}
    marks = {
        str(mark.run_id): mark
        for mark in ArchivedChain.objects.filter(run_id__in=list(heads), export=heads_path.name)
    }
    for run_id, head in heads.items():
        mark = marks.get(run_id)
        if mark is None or mark.export_digest != digest:
            raise InvalidState(f"run {run_id}: the database does not record this heads file")
        if (mark.seq, mark.hash) != (head["seq"], head["hash"]):
            raise InvalidState(f"run {run_id}: the recorded head is not the exported one")
    events_path = heads_path.with_name(str(manifest.get("events_file")))
    chains: dict[str, tuple[int, str]] = {}
    events_digest = hashlib.sha256()
    try:
        file = events_path.open("rb")
    except OSError as exc:
        raise InvalidInput(f"cannot read {events_path}: {exc.strerror}") from None
    with file:
        for raw in file:
            events_digest.update(raw)
            row = json.loads(raw)
            run_id = row["run_id"]
            seq, previous = chains.get(run_id, (0, anchor_hash(run_id)))
            event = SimpleNamespace(
                **{**row, "created_at": datetime.fromisoformat(row["created_at"])}
            )
            where = f"run {run_id} event {row['seq']} (exported)"
            if row["seq"] != seq + 1:
                raise InvalidState(f"{where}: expected event {seq + 1}")
            if row["prev_hash"] != previous:
                raise InvalidState(f"{where}: does not link to the event before it")
            if row["payload_digest"] != payload_digest(row["payload"]):
                raise InvalidState(f"{where}: payload does not match its digest")
            if row["hash"] != event_hash(event):
                raise InvalidState(f"{where}: fields do not match the event's hash")
            chains[run_id] = (row["seq"], row["hash"])
    if events_digest.hexdigest() != manifest["events_sha256"]:
        raise InvalidState(f"{events_path.name} is not the events file the heads file names")
    for run_id, head in heads.items():
        if chains.get(run_id) != (head["seq"], head["hash"]):
            raise InvalidState(f"run {run_id}: the exported chain does not end at its head")
    return {"runs": len(heads), "events": sum(seq for seq, _hash in chains.values())}
