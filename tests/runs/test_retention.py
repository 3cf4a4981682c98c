"""Retention by whole months (issue 24 item 4, the slice that lands first): a month whose
runs are all terminal and pruned is verified, exported with each run's chain head and
recorded as archived; on PostgreSQL its events can then be dropped by the owner, and every
chain that remains still verifies from where the export ended."""

from __future__ import annotations

import hashlib
import io
import json
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from runs.models import ArchivedChain, AuditEntry, Run, RunEvent
from runs.services import run_create
from tests.conftest import drive
from tests.runs.test_db_role import _connect, app_role  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

MARCH = datetime(2025, 3, 14, 12, 0, tzinfo=UTC)


def _old_run(system_actor, *, created: datetime = MARCH, amount: int = 100) -> Run:
    run = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1001", "amount_cents": amount},
            actor=system_actor,
        ).id
    )
    Run.objects.filter(id=run.id).update(
        created_at=created, finished_at=timezone.now() - timedelta(days=400)
    )
    return Run.objects.get(id=run.id)


def _run(command: str, *args: str) -> str:
    out = io.StringIO()
    call_command(command, *args, stdout=out)
    return out.getvalue()


def _this_month() -> str:
    return timezone.now().strftime("%Y-%m")


@pytest.fixture
def march(sandbox, system_actor):
    """Two finished runs created in March 2025, pruned."""
    runs = [_old_run(system_actor), _old_run(system_actor, amount=200)]
    _run("prune", "--terminal-older-than", "90d")
    return [Run.objects.get(id=run.id) for run in runs]


def test_a_finished_month_is_exported_with_each_runs_chain_head(march, tmp_path):
    out = _run("retention", "--before", _this_month(), "--archive", str(tmp_path))

    assert "2025-03: archived 2 run(s)" in out
    (heads_file,) = tmp_path.glob("agentops-events-2025-03-*.heads.json")
    (events_file,) = tmp_path.glob("agentops-events-2025-03-*.jsonl")
    manifest = json.loads(heads_file.read_text())
    assert manifest["events_sha256"] == hashlib.sha256(events_file.read_bytes()).hexdigest()
    lines = [json.loads(line) for line in events_file.read_text().splitlines()]
    assert len(lines) == manifest["events"] == sum(run.event_seq for run in march)
    heads = {head["run_id"]: head for head in manifest["runs"]}
    for run in march:
        head = heads[str(run.id)]
        # where the export ends is the run's head: a later event links to it
        assert (head["seq"], head["hash"]) == (run.event_seq, run.last_event_hash)
        assert head["events"] == run.event_seq
        mark = ArchivedChain.objects.get(run=run)
        assert (mark.seq, mark.hash, mark.dropped_at) == (run.event_seq, run.last_event_hash, None)
        assert mark.export == heads_file.name
        assert mark.export_digest == hashlib.sha256(heads_file.read_bytes()).hexdigest()
    entry = AuditEntry.objects.get(action="events.archived")
    assert (entry.actor, entry.channel, entry.object_id) == ("system", "cli", "2025-03")
    assert entry.after["events"] == manifest["events"]
    # nothing left to do for the month; the chains still verify
    assert "archived 2" not in _run(
        "retention", "--before", _this_month(), "--archive", str(tmp_path)
    )
    _run("audit_verify", "--full")


def test_a_month_with_a_run_not_pruned_or_not_terminal_stays(sandbox, system_actor, tmp_path):
    _old_run(system_actor)
    _run("prune", "--terminal-older-than", "90d")
    _old_run(system_actor, amount=300)  # finished, not pruned yet
    waiting = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1004", "amount_cents": 50_000},
            actor=system_actor,
        ).id
    )
    assert waiting.status == Run.Status.WAITING_APPROVAL
    Run.objects.filter(id=waiting.id).update(created_at=MARCH)

    out = _run("retention", "--before", _this_month(), "--archive", str(tmp_path))

    assert "2025-03: 3 run(s), 0 archived" in out
    assert "cannot go yet: 1 not terminal, 1 not pruned" in out
    assert not ArchivedChain.objects.exists()
    assert list(tmp_path.iterdir()) == []


def test_retention_refuses_a_bad_or_current_month():
    with pytest.raises(CommandError, match="is not a month"):
        _run("retention", "--before", "2025-13")
    following = timezone.now().replace(day=1) + timedelta(days=32)
    with pytest.raises(CommandError, match="at most the current month"):
        _run("retention", "--before", following.strftime("%Y-%m"))


def test_dropping_is_for_postgresql(march, tmp_path):
    if connection.vendor == "postgresql":
        pytest.skip("SQLite only: PostgreSQL drops")
    _run("retention", "--before", _this_month(), "--archive", str(tmp_path))
    with pytest.raises(CommandError, match="dropping events is for PostgreSQL"):
        _run("retention", "--before", _this_month(), "--drop")
    assert RunEvent.objects.filter(run=march[0]).count() == march[0].event_seq


def _postgresql_only():
    if connection.vendor != "postgresql":
        pytest.skip("dropping events is for PostgreSQL")


def test_dropped_events_leave_chains_that_verify_from_the_export(march, tmp_path):
    _postgresql_only()
    head = tmp_path / "head.json"
    _run("audit_verify", "--write-head", str(head))

    out = _run("retention", "--before", _this_month(), "--archive", str(tmp_path), "--drop")

    events = sum(run.event_seq for run in march)
    assert f"2025-03: dropped {events} events of 2 run(s)" in out
    assert not RunEvent.objects.filter(run__in=march).exists()
    assert not ArchivedChain.objects.filter(dropped_at__isnull=True).exists()
    entry = AuditEntry.objects.get(action="events.dropped")
    assert entry.after["events"] == events and entry.after["db_role"]
    # the runs keep their heads; the (empty) stored chains end where the export did
    assert "intact (full)" in _run("audit_verify", "--full")
    _run("audit_verify")
    # a head recorded before the drop still holds: the dropped events are counted as exported
    _run("audit_verify", "--expect-head", str(head))
    # a prune pass does not take the archived runs for unpruned ones
    assert "nothing to prune" in _run("prune", "--terminal-older-than", "90d")


def test_a_dropped_chain_must_start_where_its_export_ended(march, tmp_path):
    _postgresql_only()
    _run("retention", "--before", _this_month(), "--archive", str(tmp_path), "--drop")
    # an archive head that is not the run's: the stored chain (here: the run's head) does not
    # start where the export ended
    ArchivedChain.objects.filter(run=march[0]).update(hash="0" * 64)
    with pytest.raises(CommandError, match=f"run {march[0].id} event .*head hash"):
        _run("audit_verify", "--full")


def test_the_trigger_lets_only_archived_events_be_deleted(march, tmp_path):
    _postgresql_only()
    archived, kept = march
    _run("retention", "--before", _this_month(), "--archive", str(tmp_path))
    ArchivedChain.objects.filter(run=kept).delete()

    def delete(run: Run, *, asked: bool) -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            if asked:
                cursor.execute("SET LOCAL agentops.drop_archived = 'on'")
            cursor.execute("DELETE FROM runs_runevent WHERE run_id = %s", [run.id])

    # not asked for: refused, archived or not
    with pytest.raises(DatabaseError, match="append-only"):
        delete(archived, asked=False)
    # asked for, but the run was never archived: refused
    with pytest.raises(DatabaseError, match="append-only"):
        delete(kept, asked=True)
    delete(archived, asked=True)
    assert not RunEvent.objects.filter(run=archived).exists()
    assert RunEvent.objects.filter(run=kept).count() == kept.event_seq


def test_an_export_is_checked_from_each_runs_start_to_the_recorded_head(march, tmp_path):
    _run("retention", "--before", _this_month(), "--archive", str(tmp_path))
    (heads_file,) = tmp_path.glob("*.heads.json")
    (events_file,) = tmp_path.glob("*.jsonl")

    out = _run("audit_verify", "--export", str(heads_file))
    assert f"ok: {sum(run.event_seq for run in march)} exported events of 2 run(s)" in out

    # an exported event edited: its chain no longer links
    lines = events_file.read_text().splitlines(keepends=True)
    row = json.loads(lines[2])
    lines[2] = json.dumps({**row, "actor": "user:mallory"}, sort_keys=True) + "\n"
    events_file.write_text("".join(lines))
    with pytest.raises(CommandError, match=f"run {row['run_id']} event {row['seq']} .*hash"):
        _run("audit_verify", "--export", str(heads_file))
    # a heads file the database did not record
    heads_file.write_text(heads_file.read_text().replace('"month"', '"month" ', 1))
    with pytest.raises(CommandError, match="does not record this heads file"):
        _run("audit_verify", "--export", str(heads_file))


def test_the_application_role_cannot_drop_archived_events(march, tmp_path, app_role):  # noqa: F811
    """Only the owner drops: the application's role holds no DELETE on the events, whatever
    the transaction asks for."""
    _run("retention", "--before", _this_month(), "--archive", str(tmp_path))
    with _connect(user=app_role) as app, app.transaction(force_rollback=True):
        app.execute("SET LOCAL agentops.drop_archived = 'on'")
        with pytest.raises(psycopg.Error) as caught:
            app.execute("DELETE FROM runs_runevent WHERE run_id = %s", [march[0].id])
    assert caught.value.sqlstate == "42501"  # insufficient_privilege
