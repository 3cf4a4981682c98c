"""Tamper evidence: audit_verify finds rewritten history; PostgreSQL refuses raw rewrites."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from runs.models import RunEvent
from runs.services import run_create
from tests.conftest import drive


@pytest.fixture
def finished_run(sandbox, system_actor):
    run = run_create(
        agent_name="refund", input={"order_id": "ord_1001", "amount_cents": 100}, actor=system_actor
    )
    return drive(run.id)


def _raw(sql: str, params: list) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def _tamper(sql: str, params: list) -> None:
    """An attacker with the table owner's rights: on PostgreSQL they must first disable the
    append-only trigger (inside the test's transaction, rolled back afterwards)."""
    if connection.vendor == "postgresql":
        _raw("SET CONSTRAINTS ALL IMMEDIATE", [])  # ALTER refuses pending deferred checks
        _raw("ALTER TABLE runs_runevent DISABLE TRIGGER runs_runevent_append_only", [])
    _raw(sql, params)
    if connection.vendor == "postgresql":
        _raw("ALTER TABLE runs_runevent ENABLE TRIGGER runs_runevent_append_only", [])


@pytest.mark.django_db
def test_audit_verify_passes_on_an_untouched_record(finished_run, capsys):
    call_command("audit_verify")
    assert "1 run chain(s) intact" in capsys.readouterr().out
    call_command("audit_verify", run=str(finished_run.id))


@pytest.mark.django_db
def test_audit_verify_names_the_first_edited_event(finished_run):
    event = RunEvent.objects.get(run=finished_run, seq=5)
    _tamper(
        "UPDATE runs_runevent SET payload = %s WHERE id = %s",
        ['{"tool": "refund_payment", "attempt": 1}', event.id],
    )
    with pytest.raises(CommandError, match=f"run {finished_run.id} event 5: payload"):
        call_command("audit_verify")


@pytest.mark.django_db
def test_audit_verify_finds_a_deleted_event(finished_run):
    run_id = finished_run.id.hex if connection.vendor == "sqlite" else finished_run.id
    _tamper("DELETE FROM runs_runevent WHERE run_id = %s AND seq = 3", [run_id])
    with pytest.raises(CommandError, match="event 3: missing"):
        call_command("audit_verify", run=str(finished_run.id))


@pytest.mark.django_db
def test_postgresql_rejects_raw_update_and_delete_of_events(finished_run):
    if connection.vendor != "postgresql":
        pytest.skip("the database-level trigger exists on PostgreSQL only")
    event = RunEvent.objects.get(run=finished_run, seq=2)
    for sql in (
        "UPDATE runs_runevent SET actor = 'someone-else' WHERE id = %s",
        "DELETE FROM runs_runevent WHERE id = %s",
    ):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            _raw(sql, [event.id])
    assert RunEvent.objects.get(id=event.id).actor == event.actor
    call_command("audit_verify")


@pytest.mark.django_db
def test_audit_verify_rejects_an_unknown_run_id():
    with pytest.raises(CommandError, match="is not a run id"):
        call_command("audit_verify", run="nope")


@pytest.mark.django_db
def test_audit_verify_finds_reordered_events(finished_run):
    """Swapping two events' places (their seq numbers) breaks the chain at the first one."""
    first = RunEvent.objects.get(run=finished_run, seq=2)
    second = RunEvent.objects.get(run=finished_run, seq=3)
    # through a free seq: (run, seq) is unique
    _tamper("UPDATE runs_runevent SET seq = 1000 WHERE id = %s", [first.id])
    _tamper("UPDATE runs_runevent SET seq = 2 WHERE id = %s", [second.id])
    _tamper("UPDATE runs_runevent SET seq = 3 WHERE id = %s", [first.id])
    with pytest.raises(CommandError, match=f"run {finished_run.id} event 2: does not link"):
        call_command("audit_verify", run=str(finished_run.id))


@pytest.mark.django_db
def test_audit_verify_finds_an_event_whose_hashes_were_recomputed_but_not_its_successor(
    finished_run,
):
    """Rewriting one event and recomputing its own digest and hash is still caught: the next
    event links to the old hash."""
    from runs.record.chain import event_hash, payload_digest

    event = RunEvent.objects.get(run=finished_run, seq=4)
    event.actor = "user:mallory"
    event.payload_digest = payload_digest(event.payload)
    new_hash = event_hash(event)
    _tamper(
        "UPDATE runs_runevent SET actor = %s, hash = %s WHERE id = %s",
        [event.actor, new_hash, event.id],
    )
    with pytest.raises(CommandError, match="event 5: does not link"):
        call_command("audit_verify")


# --- the audit entry chain ---------------------------------------------------------------------


def _entries(n: int = 3) -> list:
    from runs.audit.entries import audit_record

    return [
        audit_record(
            action="token.created",
            actor="user:root",
            channel="cli",
            object_type="api_token",
            object_id=i,
            after={"name": f"agent-{i}"},
        )
        for i in range(n)
    ]


def _tamper_entries(sql: str, params: list) -> None:
    if connection.vendor == "postgresql":
        _raw("SET CONSTRAINTS ALL IMMEDIATE", [])
        _raw("ALTER TABLE runs_auditentry DISABLE TRIGGER runs_auditentry_append_only", [])
    _raw(sql, params)
    if connection.vendor == "postgresql":
        _raw("ALTER TABLE runs_auditentry ENABLE TRIGGER runs_auditentry_append_only", [])


@pytest.mark.django_db
def test_audit_entries_chain_and_verify(capsys):
    from runs.audit.entries import AUDIT_ANCHOR

    first, second, third = _entries()
    assert first.prev_hash == AUDIT_ANCHOR
    assert (second.prev_hash, third.prev_hash) == (first.hash, second.hash)
    call_command("audit_verify")
    out = capsys.readouterr().out
    assert "3 audit entries intact" in out
    assert f"audit head {third.hash} (entry {third.id})" in out
    call_command("audit_verify", audit_head=third.hash)


@pytest.mark.django_db
def test_audit_entries_refuse_orm_update_and_delete():
    from runs.models import AppendOnlyError, AuditEntry

    (entry,) = _entries(1)
    entry.actor = "user:mallory"
    with pytest.raises(AppendOnlyError):
        entry.save()
    with pytest.raises(AppendOnlyError):
        entry.delete()
    with pytest.raises(AppendOnlyError):
        AuditEntry.objects.filter(id=entry.id).update(actor="user:mallory")
    with pytest.raises(AppendOnlyError):
        AuditEntry.objects.filter(id=entry.id).delete()
    assert AuditEntry.objects.get(id=entry.id).actor == "user:root"


@pytest.mark.django_db
def test_postgresql_rejects_raw_update_and_delete_of_audit_entries():
    if connection.vendor != "postgresql":
        pytest.skip("the database-level trigger exists on PostgreSQL only")
    from runs.models import AuditEntry

    (entry,) = _entries(1)
    for sql in (
        "UPDATE runs_auditentry SET actor = 'user:mallory' WHERE id = %s",
        "DELETE FROM runs_auditentry WHERE id = %s",
    ):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            _raw(sql, [entry.id])
    assert AuditEntry.objects.get(id=entry.id).actor == "user:root"


@pytest.mark.django_db
def test_audit_verify_names_an_edited_audit_entry():
    first, second, third = _entries()
    _tamper_entries(
        "UPDATE runs_auditentry SET after = %s WHERE id = %s", ['{"name": "other"}', second.id]
    )
    with pytest.raises(CommandError, match=f"audit entry {second.id}: before/after values"):
        call_command("audit_verify")


@pytest.mark.django_db
def test_audit_verify_names_an_audit_entry_whose_fields_changed():
    first, second, third = _entries()
    _tamper_entries("UPDATE runs_auditentry SET actor = 'user:x' WHERE id = %s", [second.id])
    with pytest.raises(CommandError, match=f"audit entry {second.id}: fields do not match"):
        call_command("audit_verify")


@pytest.mark.django_db
def test_audit_verify_finds_a_deleted_audit_entry():
    first, second, third = _entries()
    _tamper_entries("DELETE FROM runs_auditentry WHERE id = %s", [second.id])
    with pytest.raises(CommandError, match=f"audit entry {third.id}: does not link"):
        call_command("audit_verify")


@pytest.mark.django_db
def test_audit_verify_finds_reordered_audit_entries():
    """Two entries swapped in place: every column but the id exchanged, each entry still
    self-consistent (its own hash matches), but the links no longer do."""
    import json

    from runs.models import AuditEntry

    first, second, _third = _entries()
    columns = [
        "created_at",
        "action",
        "actor",
        "object_id",
        "after",
        "payload_digest",
        "prev_hash",
        "hash",
    ]

    def values(entry):
        row = [getattr(entry, c) for c in columns]
        row[columns.index("after")] = json.dumps(entry.after)
        return row

    assignments = ", ".join(f"{c} = %s" for c in columns)
    sql = f"UPDATE runs_auditentry SET {assignments} WHERE id = %s"
    # hash is unique: park the first row's hash while the second takes it
    _tamper_entries("UPDATE runs_auditentry SET hash = 'parked' WHERE id = %s", [first.id])
    _tamper_entries(sql, [*values(first), second.id])
    _tamper_entries(sql, [*values(second), first.id])
    assert AuditEntry.objects.get(id=first.id).object_id == "1"
    with pytest.raises(CommandError, match=f"audit entry {first.id}: does not link"):
        call_command("audit_verify")


@pytest.mark.django_db
def test_audit_verify_finds_a_truncated_audit_log_from_a_recorded_head():
    first, second, third = _entries()
    _tamper_entries("DELETE FROM runs_auditentry WHERE id = %s", [third.id])
    call_command("audit_verify")  # the chain that is left is consistent in itself ...
    with pytest.raises(CommandError, match="no longer in the audit log"):
        call_command("audit_verify", audit_head=third.hash)  # ... but the recorded head is gone


@pytest.mark.django_db
def test_audit_verify_rejects_a_malformed_head():
    with pytest.raises(CommandError, match="64-character hex"):
        call_command("audit_verify", audit_head="nothex")


# --- pinned heads: an emptied or rewound table ---------------------------------------------------


def _empty(table: str, where: str = "") -> None:
    """Rows removed by someone who got past the guards (on PostgreSQL: a superuser switching
    triggers off for the test's transaction)."""
    if connection.vendor == "postgresql":
        _raw("SET CONSTRAINTS ALL IMMEDIATE", [])
        _raw("SET LOCAL session_replication_role = replica", [])
    _raw(f"DELETE FROM {table} {where}", [])
    if connection.vendor == "postgresql":
        _raw("SET LOCAL session_replication_role = origin", [])


@pytest.mark.django_db
def test_a_written_head_is_still_there_after_more_entries(finished_run, tmp_path, capsys):
    head = tmp_path / "head.json"
    _entries(2)
    call_command("audit_verify", write_head=str(head))
    _entries(1)
    call_command("audit_verify", expect_head=str(head), write_head=str(head))
    out = capsys.readouterr().out
    assert f"every entry and event of the head {head} is there" in out
    assert '"count": 3' in head.read_text()


@pytest.mark.django_db
def test_an_emptied_audit_log_fails_against_the_head(tmp_path):
    head = tmp_path / "head.json"
    _entries(2)
    call_command("audit_verify", write_head=str(head))
    _empty("runs_auditentry")
    # the chain itself is intact, and empty
    call_command("audit_verify")
    with pytest.raises(CommandError, match="audit entries: the newest one .* is gone"):
        call_command("audit_verify", expect_head=str(head))


@pytest.mark.django_db
def test_emptied_events_fail_against_the_head(finished_run, tmp_path):
    from runs.audit.heads import chain_head, head_problems

    head = chain_head()
    _empty("runs_runevent")
    # the runs still count their events: the chain check alone already says so
    with pytest.raises(CommandError, match=f"run {finished_run.id} .* 0 stored"):
        call_command("audit_verify")
    # with the runs gone too, only the head does
    (problem, counted) = head_problems(head)
    assert problem.startswith("events: the newest one when the head was recorded")
    assert counted.startswith(f"events: {head['events']['count']} existed up to id")


@pytest.mark.django_db
def test_a_rewound_audit_log_fails_against_the_head(tmp_path):
    first, second, third = _entries(3)
    head = tmp_path / "head.json"
    call_command("audit_verify", write_head=str(head))
    _empty("runs_auditentry", f"WHERE id >= {second.id}")
    # re-appended after the cut: a chain that verifies, with a different newest entry
    _entries(2)
    call_command("audit_verify")
    with pytest.raises(CommandError, match="head does not match"):
        call_command("audit_verify", expect_head=str(head))


@pytest.mark.django_db
def test_expect_head_refuses_a_file_that_is_not_a_head(tmp_path):
    bad = tmp_path / "head.json"
    bad.write_text('{"format": "something-else"}')
    with pytest.raises(CommandError, match="not an audit head"):
        call_command("audit_verify", expect_head=str(bad))
    with pytest.raises(CommandError, match="cannot read"):
        call_command("audit_verify", expect_head=str(tmp_path / "missing.json"))


# --- incremental verification ------------------------------------------------------------------


def _verify(*args: str, **options) -> str:
    out = io.StringIO()
    call_command("audit_verify", *args, stdout=out, **options)
    return out.getvalue()


@pytest.mark.django_db
def test_a_verified_run_is_not_read_again_until_it_has_new_events(finished_run):
    from runs.models import VerifiedChain

    assert "1 run chain(s) intact; 0 unchanged" in _verify()
    mark = VerifiedChain.objects.get(run=finished_run)
    assert (mark.seq, mark.hash) == (finished_run.event_seq, finished_run.last_event_hash)
    assert "0 run chain(s) intact; 1 unchanged" in _verify()
    assert "1 run chain(s) intact (full)" in _verify("--full")


@pytest.mark.django_db
def test_an_event_rewritten_before_the_verified_head_is_found_by_full_only(finished_run):
    """What incremental mode does not cover (docs/audit.md): it does not read events it
    verified before, so an owner who rewrites one of them is found by ``--full``."""
    _verify()
    event = RunEvent.objects.get(run=finished_run, seq=3)
    _tamper("UPDATE runs_runevent SET actor = 'user:mallory' WHERE id = %s", [event.id])
    assert "0 run chain(s) intact; 1 unchanged" in _verify()
    with pytest.raises(CommandError, match=f"run {finished_run.id} event 3: fields do not match"):
        _verify("--full")


@pytest.mark.django_db
def test_incremental_verification_reads_the_events_after_the_verified_point(finished_run):
    from runs.models import VerifiedChain

    # verified earlier up to event 4: events 5 and on are read, and event 4 must still be there
    event = RunEvent.objects.get(run=finished_run, seq=4)
    VerifiedChain.objects.create(
        run=finished_run, seq=4, hash=event.hash, verified_at=timezone.now()
    )
    later = RunEvent.objects.get(run=finished_run, seq=6)
    _tamper("UPDATE runs_runevent SET type = 'run.failed' WHERE id = %s", [later.id])
    with pytest.raises(CommandError, match="event 6: fields do not match"):
        _verify()
    _tamper("UPDATE runs_runevent SET type = %s WHERE id = %s", [later.type, later.id])
    _tamper("UPDATE runs_runevent SET hash = 'x' WHERE id = %s", [event.id])
    with pytest.raises(CommandError, match="event 4: changed since audit_verify verified it"):
        _verify()


@pytest.mark.django_db
def test_incremental_verification_finds_emptied_events_of_verified_runs(finished_run):
    _verify()
    _empty("runs_runevent")
    # the run rows were left alone: the run looks unchanged, its verified head is gone
    with pytest.raises(CommandError, match=f"run {finished_run.id} event .*: gone or changed"):
        _verify()
    with pytest.raises(CommandError, match="0 stored"):
        _verify("--full")
