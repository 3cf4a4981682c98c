"""``manage.py bench``: refuses SQLite with one clear line; on PostgreSQL a tiny run writes
a report whose shape docs/benchmarks.md describes (the numbers themselves are not asserted:
speed goes to the benchmark, not to the test suite)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection

from agentops.bench import agents
from runs.registry import registry

needs_postgres = pytest.mark.skipif(
    settings.IS_SQLITE, reason="bench measures PostgreSQL only (on SQLite it refuses to run)"
)


def _bench_cli(database_url: str) -> subprocess.CompletedProcess:
    """``manage.py bench --quick`` as a user runs it, against ``database_url``."""
    return subprocess.run(
        [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "bench", "--quick"],
        cwd=settings.BASE_DIR,
        env=dict(os.environ, DATABASE_URL=database_url),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(not settings.IS_SQLITE, reason="the SQLite refusal is checked on SQLite")
def test_it_refuses_sqlite_with_one_line_and_a_nonzero_exit(tmp_path):
    done = _bench_cli(f"sqlite:///{tmp_path / 'x.sqlite3'}")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "bench needs PostgreSQL" in lines[0]


@needs_postgres
def test_a_database_that_does_not_exist_is_one_line_and_a_nonzero_exit():
    db = settings.DATABASES["default"]
    url = f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/no_such_db"
    done = _bench_cli(url)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "cannot connect to the database" in lines[0] and "no_such_db" in lines[0]


@pytest.mark.django_db
@pytest.mark.skipif(not settings.IS_SQLITE, reason="the SQLite refusal is checked on SQLite")
def test_call_command_raises_command_error_on_sqlite():
    with pytest.raises(CommandError, match="bench needs PostgreSQL"):
        call_command("bench", "--quick")


@needs_postgres
@pytest.mark.django_db(transaction=True)
def test_quick_in_process_sections_report_their_figures(tmp_path, roles):
    output = tmp_path / "report.json"
    call_command(
        "bench",
        "--in-place",
        "--only",
        "overhead,pages",
        "--steps",
        "3",
        "--overhead-runs",
        "3",
        "--page-runs",
        "40",
        "--page-steps",
        "4",
        "--page-repeat",
        "3",
        "--output",
        str(output),
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
    report = json.loads(output.read_text())
    assert report["meta"]["postgresql"] and report["meta"]["sections"] == ["overhead", "pages"]

    overhead = {row["agent"]: row for row in report["results"]["overhead"]}
    assert set(overhead) == {agents.READ_AGENT, agents.IDEMPOTENT_AGENT}
    for row in overhead.values():
        # every run really went through the engine to the end
        assert row["succeeded"] == 3
        assert row["step_ms_p50"] > 0 and row["step_ms_p95"] >= row["step_ms_p50"]
        assert row["queries_per_step"] > 0
    counts = {row["agent"]: row for row in report["results"]["per_step_counts"]}
    # the design's boundaries: decided+dispatching, then receipt+step_completed
    assert counts[agents.READ_AGENT]["commits_per_step"] == 2
    assert counts[agents.IDEMPOTENT_AGENT]["commits_per_step"] <= 3

    pages = report["results"]["pages"]
    assert pages["runs_in_table"] >= 40 and pages["big_run_steps"] == 4
    for label in ("runs list", "run detail (1 run of N steps)", "GET /api/v1/runs/"):
        figures = pages["pages"][label]
        assert "error" not in figures, figures
        assert figures["queries"] > 0 and figures["ms_p95"] >= figures["ms_p50"] > 0
        # the pages' query counts do not grow with the number of rows
        assert figures["queries_constant"] is True, figures

    targets = {check["target"] for check in report["targets"]}
    assert "engine overhead p50 <= 2 ms per step" in targets
    assert "page query counts constant in rows" in targets
    # the bench's agents never stay in the app's registry
    assert agents.READ_AGENT not in {agent.name for agent in registry.agents()}


@needs_postgres
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_quick_worker_sections_measure_real_workers(tmp_path, roles):
    output = tmp_path / "report.json"
    call_command(
        "bench",
        "--in-place",
        "--only",
        "throughput,approval",
        "--runs",
        "3",
        "--steps",
        "2",
        "--approvals",
        "2",
        "--limit-seconds",
        "0.2",
        "--rounds",
        "2",
        "--output",
        str(output),
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
    report = json.loads(output.read_text())
    rows = report["results"]["throughput"]
    assert {(row["agent"], row["workers"]) for row in rows} == {
        (agents.READ_AGENT, 1),
        (agents.IDEMPOTENT_AGENT, 1),
        (agents.READ_AGENT, 2),
        (agents.IDEMPOTENT_AGENT, 2),
    }
    for row in rows:
        assert row["succeeded"] == 3, row
        assert row["steps_per_s"] > 0 and row["insert_commit_per_s"] > 0
        # worker CPU comes from /proc in clock ticks (10 ms): a tiny run may read 0
        assert row["commits_per_step"] > 0 and row["worker_cpu_ms_per_step"] >= 0
        # issue 24: each figure is the median of interleaved rounds, each round kept with
        # the machine's load and CPU steal beside it
        assert row["rounds_measured"] == 2 and [r["round"] for r in row["rounds"]] == [1, 2]
        limits = row["ratio_to_limit_range"]
        assert limits["min"] <= row["ratio_to_limit"] <= limits["max"]
        for sample in row["rounds"]:
            assert sample["succeeded"] == 3 and sample["load_start"] >= 0
            assert 0 <= sample["steal_pct"] <= 100 and 0 <= sample["cpu_busy_pct"] <= 100
    approval = report["results"]["approval"]
    assert approval["dispatched"] == 2 and approval["ms_p50"] > 0
    verdicts = {check["target"]: check["holds"] for check in report["targets"]}
    assert "approval -> dispatch p50 <= 300 ms" in verdicts
    assert connection.vendor == "postgresql"


@needs_postgres
@pytest.mark.django_db(transaction=True)
def test_the_scale_section_fills_chains_audit_verify_accepts_and_reports_each_read(tmp_path, roles):
    """Issue 24: ``--only scale`` fills the record with finished runs whose hash chains are
    real (``audit_verify`` passes on them) and times each read with its plans."""
    from runs.models import Run

    output = tmp_path / "report.json"
    call_command(
        "bench",
        "--in-place",
        "--only",
        "scale",
        "--scale-runs",
        "300",
        "--scale-events",
        "1500",
        "--scale-big-events",
        "60",
        "--scale-repeat",
        "2",
        "--output",
        str(output),
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
    scale = json.loads(output.read_text())["results"]["scale"]
    assert scale["runs_in_table"] >= 300 and scale["fill"]["events_per_run"] == 5
    filled = Run.objects.filter(event_seq=5, status=Run.Status.SUCCEEDED).first()
    out = io.StringIO()
    # --full: the bench marks the filled runs verified (for its incremental measurement)
    call_command("audit_verify", run=str(filled.id), full=True, stdout=out)
    assert "1 run chain(s) intact (full)" in out.getvalue()
    assert scale["audit_verify_incremental_s"] > 0
    for label in ("dashboard", "runs list", "runs list ?status=failed", "GET /api/v1/runs/"):
        figures = scale["pages"][label]
        assert "error" not in figures, figures
        assert figures["queries"] > 0 and figures["ms_p95"] >= figures["ms_p50"] > 0
    assert scale["sweeper"]["queries"] > 0 and scale["claim"]["ratio_p50"] > 0
    assert scale["prune"]["batch"] > 0
    assert set(scale["targets"]) >= {"pages_ok", "sweeper_ok", "claim_ok", "plans_ok"}


def test_interleaved_rounds_report_the_median_ratio_and_its_range():
    """Issue 24 item 6: one noisy round does not decide the figure — the median of the
    rounds' ratios does, and the range shows how far the machine moved them."""
    from agentops.bench.measure import throughput_summary

    def round_(number, ours, theirs, limit, steal):
        row = {
            "agent": agents.READ_AGENT,
            "workers": 2,
            "task_processes_per_worker": 1,
            "runs": 10,
            "steps_per_run": 10,
            "succeeded": 10,
            "finished": 10,
            "steps_per_s": ours,
            "commits_per_step": 1.5,
            "worker_cpu_ms_per_step": 2.0,
        }
        return {
            "round": number,
            "limit": {"commits_per_s": limit},
            "dbos": {"steps_per_s": theirs},
            "rows": {agents.READ_AGENT: row},
            "machine": {"load_start": 0.5, "load_end": 2.0, "steal_pct": steal},
        }

    summary = throughput_summary(
        agents.READ_AGENT,
        [
            round_(1, 600, 250, 3000, 0.0),
            round_(2, 300, 300, 2000, 9.5),
            round_(3, 550, 250, 3000, 0.1),
        ],
    )
    assert summary["ratio_to_dbos"] == {"median": 2.2, "min": 1.0, "max": 2.4}
    assert summary["steps_per_s"] == 550 and summary["dbos"]["steps_per_s"] == 250
    assert summary["ratio_to_limit_range"] == {"median": 0.183, "min": 0.15, "max": 0.2}
    assert [r["steal_pct"] for r in summary["rounds"]] == [0.0, 9.5, 0.1]


@needs_postgres
@pytest.mark.django_db(transaction=True)
def test_a_step_is_one_statement_with_policies_read_as_deployed():
    """The hot path's statements per step (docs/benchmarks.md), with what a process
    remembers of the published policies and the principal's groups as deployed (read again
    only when a claim reports a change: runs.record.configcache): a read step is ONE
    statement; an idempotent step three (decided+dispatching, the pre-send check reading
    back the deadlines that statement set, the receipt) — no policy query."""
    from agentops.bench import measure

    agents.register()
    try:
        read = measure.steady_state_counts(agent=agents.READ_AGENT)
        idempotent = measure.steady_state_counts(agent=agents.IDEMPOTENT_AGENT)
    finally:
        agents.unregister()
    assert read["queries_per_step"] == 1, read
    assert idempotent["queries_per_step"] == 3, idempotent


@needs_postgres
@pytest.mark.django_db(transaction=True)
def test_a_limit_that_does_not_bind_keeps_a_step_at_two_commits():
    """Issue 26's "no extra round trip on the hot path": with a limit that does not bind,
    an idempotent step's decision and dispatch still share one commit (the run's lock, the
    capacity row's upsert-and-lock, ONE look at what holds a slot and who waits, and the
    checkpoint's statement that also writes the grant), and after the receipt one look at
    whether anyone waits for the slot it freed: 7 statements and 2 commits, where the
    unlimited step is 2 and 2 (it was 15 and 3). No waiter or share row is written while
    nobody waits (the principal's share row once, at its first grant)."""
    from agentops.bench import measure
    from agentops.bench.flowcontrol import NOT_BINDING, tool_limit
    from runs.models import ToolShare, ToolWaiter

    agents.register()
    try:
        free = measure.steady_state_counts(agent=agents.IDEMPOTENT_AGENT)
        with tool_limit(agents.IdempotentAgent.tool_name, NOT_BINDING):
            # the principal's share row is written at its first grant on the limit, once
            measure.steady_state_counts(agent=agents.IDEMPOTENT_AGENT)
            limited = measure.steady_state_counts(agent=agents.IDEMPOTENT_AGENT)
            assert ToolShare.objects.count() == 1
            assert not ToolWaiter.objects.exists()
    finally:
        agents.unregister()
    assert (free["queries_per_step"], free["commits_per_step"]) == (2, 2), free
    assert (limited["queries_per_step"], limited["commits_per_step"]) == (7, 2), limited


@needs_postgres
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_flow_section_reports_a_limit_that_does_not_bind_and_the_sandbox_view_of_one_that_does(
    tmp_path, roles
):
    """Issue 26: ``--only flow`` runs the throughput method with and without a limit that
    does not bind, and a binding limit whose maximum in flight the sandbox itself reports:
    never above the limit, and reached."""
    from runs.models import ToolLimit

    output = tmp_path / "report.json"
    call_command(
        "bench",
        "--in-place",
        "--only",
        "flow",
        "--runs",
        "3",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--flow-runs",
        "8",
        "--output",
        str(output),
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
    report = json.loads(output.read_text())
    flow = report["results"]["flow"]
    assert "error" not in flow, flow
    free = flow["not_binding"]
    assert free["succeeded"] == 3 and free["ratio"]["median"] > 0
    for side in ("unlimited", "limited"):
        assert free[side]["steps_per_s"] > 0 and free[side]["queries_per_step"] > 0
    # a limited tool's call is decided, then dispatched under its limit: more per step
    assert free["limited"]["queries_per_step"] > free["unlimited"]["queries_per_step"]

    bound = flow["binding"]
    assert bound["max_in_flight"] == 2
    for side in ("unlimited", "limited"):
        assert bound[side]["succeeded"] == 8, bound[side]
        assert bound[side]["sandbox_requests"] == 8 * 2
    # the downstream's own count: the limit held, and the workers reached it
    assert bound["limited"]["sandbox_max_in_flight"] <= 2
    assert bound["limited"]["record_max_in_flight_at_grant"] <= 2
    verdicts = {check["target"]: check for check in report["targets"]}
    assert any(name.startswith("flow: with a binding limit") for name in verdicts)
    # the operators' limits the bench set are gone again
    assert not ToolLimit.objects.exists()
    assert agents.SANDBOX_AGENT not in {agent.name for agent in registry.agents()}


def test_the_flow_targets_hold_only_at_the_limit_and_within_ten_percent():
    from agentops.bench.management.commands.bench import targets

    def report(ratio, seen):
        side = {"queries_per_step": 3, "commits_per_step_exact": 2, "steps_per_s": 100.0}
        bound = {"sandbox_max_in_flight": seen, "steps_per_s": 50.0}
        return {
            "flow": {
                "not_binding": {
                    "max_in_flight": 1000,
                    "rounds_measured": 3,
                    "ratio": {"median": ratio, "min": ratio, "max": ratio},
                    "unlimited": side,
                    "limited": side,
                },
                "binding": {
                    "max_in_flight": 2,
                    "unlimited": {**bound, "sandbox_max_in_flight": 6},
                    "limited": bound,
                },
            }
        }

    def verdicts(results):
        return [check["holds"] for check in targets(results) if check["target"].startswith("flow")]

    assert verdicts(report(0.95, 2)) == [True, True]
    assert verdicts(report(0.85, 2)) == [False, True]
    # over the limit, or never reaching it (the limit did not bind): both miss
    assert verdicts(report(0.95, 3)) == [True, False]
    assert verdicts(report(0.95, 1)) == [True, False]
