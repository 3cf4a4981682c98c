"""Crashes of real worker processes: a ``runworker`` process group SIGKILLed by
``AGENTOPS_CRASH_AT`` at every checkpoint boundary, and a short run of the ``chaos`` harness.
Whatever the moment, a restarted worker finishes the run, and the sandbox (which does NOT
deduplicate) has exactly one refund per idempotency key."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command

from approvals.models import Approval
from approvals.services import approval_decide
from runs.actors import Actor
from runs.faults import BOUNDARIES
from runs.models import Run, RunEvent
from runs.services import run_create
from tests.runs.workerprocs import wait_for, worker_env
from tests.support import event_types, events, refund_posts, refunds

SMALL = {"order_id": "ord_1002", "amount_cents": 700}
LARGE = {"order_id": "ord_1004", "amount_cents": 20_000}  # above the approval threshold

# boundary -> (AGENTOPS_CRASH_AT, input). ":2" picks the refund's step (the lookup is the
# first), so the crash lands next to the side effect that must not happen twice; large
# refunds also pass the approval gate, whose approval must be consumed exactly once.
CASES = {
    "claimed": ("claimed", SMALL),
    "decided": ("decided:2", SMALL),
    "approval_requested": ("approval_requested", LARGE),
    "dispatching": ("dispatching:2", LARGE),
    "tool_call": ("tool_call:2", LARGE),
    "receipt_recorded": ("receipt_recorded:2", SMALL),
    "step_completed": ("step_completed:2", SMALL),
    "run_finished": ("run_finished", SMALL),
}
# the crashed worker still held the run's lease: the next claim must say it recovered it
HELD_AT_CRASH = {
    "claimed",
    "decided",
    "dispatching",
    "tool_call",
    "receipt_recorded",
    "step_completed",
}


def test_every_boundary_has_a_crash_case():
    assert set(CASES) == set(BOUNDARIES)


def _approve_pending(run_id, approver) -> None:
    for approval_id in Approval.objects.filter(
        run_id=run_id, status=Approval.Status.PENDING
    ).values_list("id", flat=True):
        approval_decide(
            approval_id=approval_id, decision="approve", actor=Actor.for_user(approver, "web")
        )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("roles")
@pytest.mark.parametrize("boundary", list(CASES))
def test_a_crash_at_every_boundary_ends_with_one_refund_and_the_run_succeeding(
    boundary, worker_procs, sandbox, system_actor, approver
):
    crash_at, input = CASES[boundary]
    run = run_create(agent_name="refund", input=input, actor=system_actor)

    crashing = worker_procs.start("crash-1", worker_env(sandbox, AGENTOPS_CRASH_AT=crash_at))
    returncode = crashing.wait_exit(30, during=lambda: _approve_pending(run.id, approver))

    assert returncode == -9, crashing.output()  # SIGKILL, by its own hand
    assert f"killing process group at {boundary}" in crashing.output()
    # the whole group died (its children linger a moment as zombies until reaped)
    wait_for(lambda: not crashing.group_alive(), 5, what="the process group to be gone")
    crashed_at = RunEvent.objects.filter(run=run).order_by("-seq").first()

    # restarted without the variable, under the same name
    worker_procs.start("crash-1", worker_env(sandbox))
    wait_for(
        lambda: (
            _approve_pending(run.id, approver) or Run.objects.get(id=run.id).status in Run.TERMINAL
        ),
        40,
        what=f"the run to end after a crash at {boundary}",
    )

    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED, (run.reason_code, run.reason_detail)
    assert run.result["refunded"] is True
    key = f"{run.id}:2"
    assert [refund["idempotency_key"] for refund in refunds(sandbox)] == [key]
    assert run.result["refund_id"] == refunds(sandbox)[0]["refund_id"]
    assert all(post["idempotency_key"] == key for post in refund_posts(sandbox))
    if boundary in HELD_AT_CRASH:
        recovered = events(run.id, "run.claimed")
        assert any(event.payload["recovered"] and event.seq > crashed_at.seq for event in recovered)
    if input is LARGE:
        assert Approval.objects.filter(run=run).count() == 1
        assert Approval.objects.get(run=run).consumed_at is not None
        assert event_types(run.id).count("approval.consumed") == 1
    seqs = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_short_chaos_run_kills_at_every_boundary_and_breaks_no_invariant():
    out = StringIO()
    call_command("chaos", runs=6, random_kills=2, timeout=150, seed=20240601, workers=2, stdout=out)

    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert report["duplicate_effects"] == 0
    assert report["lost_runs"] == 0
    assert report["double_consumed_approvals"] == 0
    assert report["runs"] == report["succeeded"] == 6
    assert report["boundaries_killed"] == list(BOUNDARIES)
    assert report["kills"] >= len(BOUNDARIES) + 2
    assert report["approvals"] >= 1
    assert report["max_recovery_seconds"] is not None


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_chaos_with_database_faults_keeps_every_invariant():
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("database faults use pg_terminate_backend: PostgreSQL only")
    out = StringIO()
    call_command(
        "chaos",
        runs=8,
        random_kills=4,
        boundaries="none",
        db_faults=True,
        timeout=150,
        seed=7,
        workers=2,
        stdout=out,
    )

    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert report["db_connections_terminated"] > 0
    # every worker outlived its connections being terminated
    assert report["workers_restarted"] == 0
    assert report["duplicate_effects"] == 0
    assert report["lost_runs"] == 0
    assert report["double_consumed_approvals"] == 0
    assert report["runs"] == report["succeeded"] == 8
    assert not Run.objects.filter(status=Run.Status.RUNNING).exists()


@pytest.mark.django_db
def test_chaos_refuses_a_restart_command_without_database_faults():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--pg-restart-cmd needs --db-faults"):
        call_command("chaos", "--pg-restart-cmd", "true")


@pytest.mark.django_db
def test_chaos_refuses_database_faults_on_sqlite():
    from django.core.management.base import CommandError
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("the refusal is for SQLite")
    with pytest.raises(CommandError, match="--db-faults needs PostgreSQL"):
        call_command("chaos", "--db-faults")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--runs", "0"], "--runs must be between 1 and 500"),
        (["--random-kills", "-1"], "--random-kills must be between 0 and 1000"),
        (["--workers", "0"], "--workers must be between 1 and 16"),
        (["--timeout", "0"], "--timeout must be a positive number"),
        (["--boundaries", "claimed,nowhere"], "unknown boundary 'nowhere'"),
    ],
)
def test_chaos_refuses_bad_options_with_one_line(arguments, message):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match=message) as raised:
        call_command("chaos", *arguments)
    assert "\n" not in str(raised.value)


@pytest.mark.django_db
def test_the_chaos_verdict_counts_a_double_refund_and_a_run_that_lost_its_refund(
    sandbox, system_actor
):
    """The harness must not pass whatever happened: fed a sandbox record with one refund
    applied twice and one missing, it reports both and fails."""
    from agentops.demo.management.commands.chaos import Harness, Options
    from tests.conftest import drive

    first = drive(run_create(agent_name="refund", input=SMALL, actor=system_actor).id)
    second = drive(run_create(agent_name="refund", input=SMALL, actor=system_actor).id)
    assert first.status == second.status == Run.Status.SUCCEEDED
    harness = Harness(
        Options(runs=2, random_kills=0, boundaries=[], workers=1, timeout=10, seed=1),
        out=lambda message, level=1: None,
    )
    harness.run_ids = [first.id, second.id]
    applied = refunds(sandbox)
    harness.refunds = [r for r in applied if r["idempotency_key"].startswith(str(first.id))] * 2

    report, problems = harness.report()
    harness.keep_logs = False
    harness.cleanup()

    assert report["duplicate_effects"] == 1
    assert report["lost_runs"] == 1  # the second run's refund is not in the sandbox's record
    assert report["double_consumed_approvals"] == 0
    assert any("duplicate" in problem for problem in problems)
    assert any("lost run" in problem for problem in problems)
