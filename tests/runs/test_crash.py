"""Crashes of real worker processes: a ``runworker`` process group SIGKILLed by
``AGENTOPS_CRASH_AT`` at every checkpoint boundary, and a short run of the ``chaos`` harness.
Whatever the moment, a restarted worker finishes the run, and the sandbox (which does NOT
deduplicate) has exactly one refund per idempotency key."""

from __future__ import annotations

import json
import time
from io import StringIO

import httpx
import pytest
from django.conf import settings
from django.core.management import call_command

from approvals.models import Approval
from approvals.services import approval_decide
from runs.actors import Actor
from runs.faults import BOUNDARIES
from runs.models import Run, RunEvent, ToolCall
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
    "before_send": ("before_send", SMALL),
    "tool_call": ("tool_call:2", LARGE),
    "receipt_recorded": ("receipt_recorded:2", SMALL),
    "step_completed": ("step_completed:2", SMALL),
    "run_finished": ("run_finished", SMALL),
    # the outbox's points (runs.outbox): the approval email's commit, claim and send
    "notify_enqueued": ("notify_enqueued", LARGE),
    "notify_claimed": ("notify_claimed", LARGE),
    "notify_sent": ("notify_sent", LARGE),
}
# the email must still be wanted when the worker reaches these: nobody decides before
NOTIFY = {"notify_enqueued", "notify_claimed", "notify_sent"}
# the crashed worker still held the run's lease: the next claim must say it recovered it
HELD_AT_CRASH = {
    "claimed",
    "decided",
    "dispatching",
    "before_send",
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
    if boundary in NOTIFY:
        approver.email = "alice@example.com"  # an approver with an address is emailed
        approver.save(update_fields=["email"])
    run = run_create(agent_name="refund", input=input, actor=system_actor)

    crashing = worker_procs.start("crash-1", worker_env(sandbox, AGENTOPS_CRASH_AT=crash_at))
    approving = None if boundary in NOTIFY else (lambda: _approve_pending(run.id, approver))
    returncode = crashing.wait_exit(30, during=approving)

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
def test_a_short_chaos_run_kills_at_every_boundary_pauses_in_every_mode_and_breaks_nothing():
    out = StringIO()
    call_command(
        "chaos",
        runs=6,
        random_kills=2,
        pauses=1,
        timeout=300,
        seed=20240601,
        workers=2,
        stdout=out,
    )

    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert report["duplicate_effects"] == 0
    assert report["duplicate_effects_by_mode"] == dict.fromkeys(
        ["kills", "key", "deadline", "nothing", "person"], 0
    )
    assert report["lost_runs"] == 0
    assert report["double_consumed_approvals"] == 0
    # every approval's email reached the approver, whose link decided it (DESIGN §9)
    assert report["lost_notifications"] == 0
    assert report["duplicate_notifications"] <= report["duplicate_notifications_allowed"]
    assert report["max_notification_seconds"] < 30
    assert report["scanner_decisions"] == 0  # a scanner opening every link decided nothing
    # the kill round's six and at least one per notify point, and one per pause round; the
    # person round's paused refund waits for a person after its absent lookup instead of
    # being sent again
    assert report["runs"] >= 6 + 3 + 4
    assert report["parked_for_person"] == 1
    assert report["succeeded"] == report["runs"] - 1
    assert report["boundaries_killed"] == list(BOUNDARIES)
    assert report["kills"] >= len(BOUNDARIES) + 2
    assert report["approvals"] >= 1
    assert report["max_recovery_seconds"] is not None
    # one pause per mode, at before_send: each frozen worker held its run, and woke up to
    # find its write refused by the fence (it sent nothing late: its own clock said no)
    assert report["pauses"] == 4
    assert report["pause_boundaries"] == ["before_send"]
    assert report["zombie_writes_refused"] == 4
    assert report["late_sends"] == 0


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("deadline_checked", [False, True], ids=["no-deadline", "deadline"])
def test_a_worker_paused_before_sending_a_refund_never_refunds_twice(
    deadline_checked, worker_procs, sandbox, system_actor
):
    """Issue 15, scenario 1: worker A commits ``dispatching`` for a refund and is frozen
    (SIGSTOP) before its request leaves; its lease expires, worker B takes the run over,
    waits out the landing window, finds the refund absent and sends it; then A is resumed.
    A non-deduplicating sandbox refunds once, whether it checks deadlines or not."""
    httpx.post(
        f"{sandbox.url}/mode", json={"dedupe": False, "deadline": deadline_checked}, timeout=5
    ).raise_for_status()
    short = {
        "AGENTOPS_SEND_WINDOW": "1",
        "AGENTOPS_SANDBOX_TIMEOUT": "1",
        "AGENTOPS_SANDBOX_HONOURS": "deadline" if deadline_checked else "",
    }
    run = run_create(agent_name="refund", input=SMALL, actor=system_actor)

    paused = worker_procs.start(
        "pause-a", worker_env(sandbox, AGENTOPS_PAUSE_AT="before_send", **short)
    )
    wait_for(
        lambda: paused.frozen() and "freezing process group at before_send" in paused.output(),
        30,
        what="worker A to freeze before sending",
    )
    assert refund_posts(sandbox) == []  # the request did not leave
    dispatch = ToolCall.objects.get(run=run, tool_name="refund_payment")
    assert dispatch.dispatch_incarnation == 1 and dispatch.send_deadline is not None

    taking_over = worker_procs.start("pause-b", worker_env(sandbox, **short))
    wait_for(
        lambda: Run.objects.get(id=run.id).status in Run.TERMINAL, 40, what="B to finish the run"
    )
    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED, (run.reason_code, run.reason_detail)
    assert run.fence >= 2  # B's incarnation
    assert any(e.payload["recovered"] for e in events(run.id, "run.claimed"))

    paused.resume()
    wait_for(
        lambda: "stopping this incarnation" in paused.output(),
        15,
        what="A to find its lease lost",
    )
    time.sleep(0.5)  # whatever A would still send has arrived by now
    assert paused.alive and taking_over.alive

    key = f"{run.id}:2"
    assert [refund["idempotency_key"] for refund in refunds(sandbox)] == [key]
    posts = refund_posts(sandbox)
    assert all(post["idempotency_key"] == key for post in posts)
    applied = [post for post in posts if post["applied"]]
    assert len(applied) == 1 and not applied[0]["late"]
    # A checked its own clock before writing a byte, so nothing late left it (a late one
    # would be counted, and refused by a sandbox checking deadlines: tests/demo)
    assert [post for post in posts if post["late"]] == []
    lost = events(run.id, "run.lease_lost")
    assert [(e.payload["worker"], e.payload["lost_fence"]) for e in lost] == [("pause-a", 1)]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_chaos_with_database_faults_keeps_every_invariant():
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("database faults use pg_terminate_backend: PostgreSQL only")
    if settings.PG_POOLER == "transaction":
        pytest.skip("chaos refuses --db-faults behind a transaction pooler")
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
        (["--pauses", "-1"], "--pauses must be between 0 and 100"),
        (["--sandbox-modes", "key,sometimes"], "--sandbox-modes: expected .* not 'sometimes'"),
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


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_chaos_with_a_tool_concurrency_limit_never_has_more_in_flight_at_the_sandbox():
    """Issue 26: a limit of 2 on the refund tool, workers killed and one frozen past its
    lease: the sandbox never had more than 2 refunds in flight at once (a slot is held until
    the receipt or the landing deadline, so a dead or frozen worker's request counts)."""
    out = StringIO()
    call_command(
        "chaos",
        runs=8,
        random_kills=3,
        boundaries="none",
        pauses=1,
        sandbox_modes="key",
        tool_concurrency=2,
        timeout=240,
        seed=26,
        workers=2,
        stdout=out,
    )

    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert report["tool_concurrency"] == 2
    assert report["duplicate_effects"] == 0
    assert report["lost_runs"] == 0
    assert report["succeeded"] == report["runs"] - report["parked_for_person"]
    assert 1 <= report["max_in_flight_calls"] <= 2
