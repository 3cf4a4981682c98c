"""Tamper evidence: audit_verify finds rewritten history; PostgreSQL refuses raw rewrites."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction

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
