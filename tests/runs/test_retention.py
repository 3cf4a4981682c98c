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
    Run.objects.filter(id=run.id).update(finished_at=timezone.now() - timedelta(days=400))
    _backdate(run, created)
    return Run.objects.get(id=run.id)


def _backdate(run: Run, created: datetime) -> None:
    """The run as if created at ``created``. A run's creation time never changes in the
    product, and its events carry it (their partition key on PostgreSQL): they move with it
    here, past the append-only trigger (a superuser switching triggers off for the test's
    transaction) — into the month's partition, or DEFAULT when it has none."""
    Run.objects.filter(id=run.id).update(created_at=created)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
            cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute(
            "UPDATE runs_runevent SET run_created_at = (SELECT r.created_at FROM runs_run r "
            "WHERE r.id = runs_runevent.run_id) WHERE run_id = %s",
            [Run._meta.pk.get_db_prep_value(run.id, connection)],
        )
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL session_replication_role = origin")


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
    _backdate(waiting, MARCH)

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


def test_the_trigger_refuses_every_delete_archived_or_not(march, tmp_path):
    """Retention drops partitions (runs 0031): the append-only trigger lets no DELETE
    through any more, not even of an archived event in a transaction that asks for it (the
    exception runs 0028 made is gone)."""
    _postgresql_only()
    _run("retention", "--before", _this_month(), "--archive", str(tmp_path))
    for asked in (False, True):
        with (
            pytest.raises(DatabaseError, match="append-only"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            if asked:
                cursor.execute("SET LOCAL agentops.drop_archived = 'on'")
            cursor.execute("DELETE FROM runs_runevent WHERE run_id = %s", [march[0].id])
    assert RunEvent.objects.filter(run=march[0]).count() == march[0].event_seq


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


# --- the events' layout: partitioned by their run's creation month (PostgreSQL, runs 0031) ---


def _partitions() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'runs_runevent'::regclass ORDER BY c.relname"
        )
        return [name for (name,) in cursor.fetchall()]


def _stored_in(event_ids: list[int]) -> set[str]:
    """The partitions that hold these events."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT tableoid::regclass::text FROM runs_runevent WHERE id = ANY(%s)",
            [event_ids],
        )
        return {name for (name,) in cursor.fetchall()}


def _month_ahead(months: int) -> str:
    now = timezone.now()
    index = now.month - 1 + months
    return f"runs_runevent_{now.year + index // 12}_{index % 12 + 1:02d}"


def test_every_event_carries_its_runs_creation_time(sandbox, system_actor):
    run = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1001", "amount_cents": 100},
            actor=system_actor,
        ).id
    )
    run.refresh_from_db()
    events = RunEvent.objects.filter(run=run)
    assert events.count() == run.event_seq > 3
    assert set(events.values_list("run_created_at", flat=True)) == {run.created_at}
    if connection.vendor == "postgresql":
        assert _stored_in(list(events.values_list("id", flat=True))) == {_month_ahead(0)}


def test_an_event_of_a_month_without_a_partition_lands_in_default(sandbox, system_actor):
    _postgresql_only()
    from runs.record.checkpoint import checkpoint

    run = _old_run(system_actor, created=datetime(2019, 5, 14, 9, 30, tzinfo=UTC))
    assert "runs_runevent_2019_05" not in _partitions()

    # through the checkpoint's one statement: the run's row gives the event its month
    with checkpoint(run.id, actor="system", channel="cli") as cp:
        cp.event("run.note", text="written after its month's partition was never made")

    note = RunEvent.objects.get(run=run, type="run.note")
    assert note.run_created_at == run.created_at
    assert _stored_in([note.id]) == {"runs_runevent_default"}
    _run("audit_verify", "--run", str(run.id))


def test_create_ahead_makes_the_coming_months_partitions_once():
    _postgresql_only()
    out = _run("retention", "--create-ahead", "6")
    assert {_month_ahead(months) for months in range(7)} <= set(_partitions())
    assert "runs_runevent_default" in _partitions()
    assert "partitions in place for this month and the next 6" in _run(
        "retention", "--create-ahead", "6"
    )
    # the migration made this month and the next three; the rest are new
    assert f"created partition {_month_ahead(6)}" in out


def test_partitions_are_for_postgresql():
    if connection.vendor == "postgresql":
        pytest.skip("SQLite only: PostgreSQL partitions the events")
    with pytest.raises(CommandError, match="partitions are for PostgreSQL"):
        _run("retention", "--create-ahead", "3")


def test_a_dropped_month_is_its_partition_detached_and_dropped(sandbox, system_actor, tmp_path):
    _postgresql_only()
    march = [_old_run(system_actor), _old_run(system_actor, amount=200)]
    april = _old_run(system_actor, created=datetime(2025, 4, 2, 8, 0, tzinfo=UTC), amount=300)
    current = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1001", "amount_cents": 400},
            actor=system_actor,
        ).id
    )
    _run("prune", "--terminal-older-than", "90d")
    # months made up by a test have no partition: their events sit in DEFAULT until
    # --create-ahead gives each its own
    assert "runs_runevent_2025_03" not in _partitions()
    out = _run("retention", "--create-ahead", "1")
    assert "created partition runs_runevent_2025_03" in out
    assert "created partition runs_runevent_2025_04" in out
    assert not _stored_in(list(RunEvent.objects.values_list("id", flat=True))) & {
        "runs_runevent_default"
    }
    march = [Run.objects.get(id=run.id) for run in march]

    out = _run("retention", "--before", "2025-04", "--archive", str(tmp_path), "--drop")

    events = sum(run.event_seq for run in march)
    assert f"2025-03: dropped {events} events of 2 run(s)" in out
    assert "runs_runevent_2025_03" not in _partitions()
    assert "runs_runevent_2025_04" in _partitions()
    assert not RunEvent.objects.filter(run__in=march).exists()
    for kept in (Run.objects.get(id=april.id), Run.objects.get(id=current.id)):
        assert RunEvent.objects.filter(run=kept).count() == kept.event_seq
    entry = AuditEntry.objects.get(action="events.dropped")
    assert entry.after["partition"] == "runs_runevent_2025_03"
    # every chain that remains verifies, the dropped ones from their exported heads
    assert "intact (full)" in _run("audit_verify", "--full")


def test_a_month_with_an_event_not_exported_is_not_dropped(march, tmp_path):
    _postgresql_only()
    from runs.record.checkpoint import checkpoint

    _run("retention", "--before", _this_month(), "--archive", str(tmp_path))
    # an event appended after the export: dropping the partition would lose it
    with checkpoint(march[0].id, actor="system", channel="cli") as cp:
        cp.event("run.note", text="after the archive")

    with pytest.raises(CommandError, match="1 stored event.* not exported"):
        _run("retention", "--before", _this_month(), "--drop")
    assert RunEvent.objects.filter(run=march[0]).count() == march[0].event_seq + 1
    assert not ArchivedChain.objects.filter(dropped_at__isnull=False).exists()


def test_the_application_role_cannot_make_or_drop_partitions(app_role):  # noqa: F811
    def refused(statement: str) -> str | None:
        with _connect(user=app_role) as app, app.transaction(force_rollback=True):
            try:
                app.execute(statement)
            except psycopg.Error as error:
                return error.sqlstate
        return None

    assert refused("SELECT agentops_event_partition('2031-01-01')") == "42501"
    detach = f"ALTER TABLE runs_runevent DETACH PARTITION {_month_ahead(0)}"
    assert refused(detach) == "42501"
