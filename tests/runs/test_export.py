"""``audit_export`` streams a time range of events as CSV or JSON lines in constant memory:
keyset-paginated queries of a fixed size, whatever the range."""

from __future__ import annotations

import csv
import io
import json
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from runs.models import Run, RunEvent
from runs.record.checkpoint import checkpoint
from runs.services import run_create
from tests.conftest import drive

pytestmark = pytest.mark.django_db


@pytest.fixture
def finished_run(sandbox, system_actor):
    run = run_create(
        agent_name="refund", input={"order_id": "ord_1001", "amount_cents": 100}, actor=system_actor
    )
    return drive(run.id)


def _export(**options) -> str:
    out = io.StringIO()
    call_command("audit_export", stdout=out, **options)
    return out.getvalue()


def _since() -> str:
    return (timezone.now() - timedelta(hours=1)).isoformat()


def test_csv_export_of_a_run_matches_its_record(finished_run):
    rows = list(csv.DictReader(io.StringIO(_export(since=_since(), run=str(finished_run.id)))))
    stored = list(RunEvent.objects.filter(run=finished_run).order_by("seq"))
    assert [int(r["seq"]) for r in rows] == [e.seq for e in stored]
    assert [r["hash"] for r in rows] == [e.hash for e in stored]
    assert json.loads(rows[0]["payload"]) == stored[0].payload
    assert rows[0]["created_at"] == stored[0].created_at.isoformat()


def test_jsonl_export_filters_by_type(finished_run):
    lines = _export(since=_since(), format="jsonl", type=["run.created", "run.succeeded"])
    records = [json.loads(line) for line in lines.splitlines()]
    assert [r["type"] for r in records] == ["run.created", "run.succeeded"]
    assert records[0]["run_id"] == str(finished_run.id)


def test_range_bounds_are_inclusive_then_exclusive(finished_run):
    first = RunEvent.objects.filter(run=finished_run).order_by("seq").first()
    exactly = first.created_at.isoformat()
    assert _export(since=exactly, format="jsonl").count("\n") >= 1
    assert _export(since=_since(), until=exactly, format="jsonl") == ""


def test_output_file(finished_run, tmp_path):
    target = tmp_path / "events.csv"
    err = io.StringIO()
    call_command("audit_export", since=_since(), output=str(target), stderr=err)
    rows = list(csv.DictReader(target.open(newline="")))
    assert len(rows) == finished_run.event_seq
    assert f"{finished_run.event_seq} event(s) written" in err.getvalue()


def test_a_large_range_is_read_in_fixed_size_chunks(system_actor, django_user_model):
    """Constant memory: every query fetches at most ``--chunk-size`` rows, and the number of
    queries grows with the range instead of one query holding it all."""
    run = run_create(
        agent_name="refund", input={"order_id": "ord_1001", "amount_cents": 100}, actor=system_actor
    )
    for batch in range(5):
        with checkpoint(run.id, actor="system", channel="cli") as cp:
            for i in range(100):
                cp.event("test.filler", batch=batch, i=i)
    total = Run.objects.get(id=run.id).event_seq
    assert total > 500

    with CaptureQueriesContext(connection) as captured:
        out = _export(since=_since(), format="jsonl", chunk_size=64)
    event_queries = [q["sql"] for q in captured if "runs_runevent" in q["sql"]]
    assert len(out.splitlines()) == total
    assert len(event_queries) == total // 64 + 1
    assert all("LIMIT 64" in sql for sql in event_queries)
    seqs = [json.loads(line)["seq"] for line in out.splitlines()]
    assert seqs == list(range(1, total + 1))  # nothing lost or repeated between chunks


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"since": "yesterday"}, "--since 'yesterday' is not a date"),
        ({"since": "2026-13-45"}, "is not a date"),
        ({"since": "2026-12-03", "until": "2026-12-02"}, "--until must be after --since"),
        ({"since": "2026-12-03", "format": "xml"}, "--format must be csv or jsonl"),
        ({"since": "2026-12-03", "run": "nope"}, "is not a run id"),
        ({"since": "2026-12-03", "run": "8d3c7a32-9a56-4c1b-9f0c-2a1f3c1b0e11"}, "does not exist"),
        ({"since": "2026-12-03", "chunk_size": 0}, "--chunk-size must be at least 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(options, message):
    with pytest.raises(CommandError, match=message):
        _export(**options)


def test_cannot_write_the_output_file(tmp_path):
    with pytest.raises(CommandError, match="cannot write"):
        _export(since="2026-12-03", output=str(tmp_path / "missing" / "x.csv"))


def test_csv_cells_cannot_become_spreadsheet_formulas(system_actor):
    run = run_create(
        agent_name="refund", input={"order_id": "ord_1001", "amount_cents": 100}, actor=system_actor
    )
    with checkpoint(run.id, actor='=HYPERLINK("http://x")', channel="cli") as cp:
        cp.event("test.formula")
    rows = list(csv.DictReader(io.StringIO(_export(since=_since(), type=["test.formula"]))))
    assert rows[0]["actor"].startswith("'=")
