"""Dry runs (issue 23 item 5): the agent runs for real, every tool that is not ``read`` goes
through its declared ``dry_run`` instead of its side effect — checked against the sandbox's
own ledger — approvals are asked and decided as usual but never used by a real run, and a
finished dry run is promoted to a real run that reuses none of its decisions."""

from __future__ import annotations

import io

import pytest
from django.db import transaction
from django.urls import reverse

from approvals.models import Approval
from approvals.services import approval_decide
from runs.actors import Actor
from runs.models import Run, ToolCall, ToolReceipt
from runs.registry import CallTool, Effect, Finish, ToolResult
from runs.services import (
    AlreadyPromoted,
    DryRunUnsupported,
    InvalidState,
    run_create,
    run_fork,
    run_promote,
)
from tests.conftest import drive
from tests.support import (
    CountingTool,
    ScriptedAgent,
    events,
    make_tool,
    refund_posts,
    refunds,
)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

SMALL_REFUND = {"order_id": "ord_1002", "amount_cents": 700}
LARGE_REFUND = {"order_id": "ord_1004", "amount_cents": 50_000}  # needs an approver


def _start(actor, input, *, dry_run=True) -> Run:
    return drive(run_create(agent_name="refund", input=input, actor=actor, dry_run=dry_run).id)


def test_a_dry_run_of_the_refund_agent_sends_nothing_to_the_payments_service(sandbox, system_actor):
    run = _start(system_actor, SMALL_REFUND)

    assert run.status == Run.Status.SUCCEEDED
    assert run.dry_run is True
    # the sandbox's own record: no refund request reached it, no refund exists
    assert refund_posts(sandbox) == []
    assert refunds(sandbox) == []
    # the order was read for real; the refund was simulated and says what it would do
    lookup, refund = ToolCall.objects.filter(run=run).order_by("step__seq")
    assert lookup.receipt.source == ToolReceipt.Source.TOOL
    assert refund.receipt.source == ToolReceipt.Source.SIMULATED
    assert refund.receipt.result["would"] == "POST /refunds: Refund 7.00 EUR to order ord_1002"
    assert run.result == {
        "refunded": False,
        "dry_run": True,
        "would": refund.receipt.result["would"],
    }
    # marked in the events: the run's creation, the dispatch and the receipt
    assert events(run.id, "run.created")[0].payload["dry_run"] is True
    (dispatching,) = [e for e in events(run.id, "tool.dispatching") if e.payload["seq"] == 2]
    assert dispatching.payload["simulated"] is True
    assert events(run.id, "tool.succeeded")[-1].payload["source"] == "simulated"


def test_a_real_run_is_unmarked(sandbox, system_actor):
    run = _start(system_actor, SMALL_REFUND, dry_run=False)

    assert run.status == Run.Status.SUCCEEDED and run.dry_run is False
    assert len(refund_posts(sandbox)) == 1
    assert "dry_run" not in events(run.id, "run.created")[0].payload
    assert all("simulated" not in e.payload for e in events(run.id, "tool.dispatching"))


def test_a_dry_run_is_refused_when_a_tool_with_side_effects_declares_no_dry_run(
    register, system_actor
):
    body = CountingTool()
    register(
        make_tool("dr_lookup", CountingTool()),
        make_tool("dr_charge", body, effect=Effect.IDEMPOTENT),
        ScriptedAgent("dr_agent", lambda ctx: Finish(), tools=("dr_lookup", "dr_charge")),
    )

    with pytest.raises(DryRunUnsupported) as refused:
        run_create(agent_name="dr_agent", actor=system_actor, dry_run=True)

    assert refused.value.code == "dry_run_unsupported"
    assert refused.value.tools == ["dr_charge"]  # the read tool needs none
    assert "dr_charge" in str(refused.value)
    assert not Run.objects.filter(agent_name="dr_agent").exists()
    # a real run of it starts as ever
    assert run_create(agent_name="dr_agent", actor=system_actor).dry_run is False


def test_a_tool_that_lost_its_dry_run_is_never_called_for_real(register, system_actor):
    body = CountingTool()
    tool = make_tool("dr_write", body, effect=Effect.IDEMPOTENT)
    tool.dry_run = lambda arguments, ctx: ToolResult(result={"would": "write"})

    def decide(ctx):
        return CallTool("dr_write", {}) if not ctx.steps else Finish(ctx.last_step.error)

    register(tool, ScriptedAgent("dr_writer", decide, tools=("dr_write",)))
    run = run_create(agent_name="dr_writer", actor=system_actor, dry_run=True)
    tool.dry_run = None  # a deploy between the start and the dispatch

    run = drive(run.id)

    assert body.calls == []
    assert run.status == Run.Status.SUCCEEDED
    assert "declares no dry_run" in run.result


def _approve(approval: Approval, user) -> None:
    approval_decide(approval_id=approval.id, decision="approve", actor=Actor.for_user(user, "web"))


def test_approvals_in_a_dry_run_are_asked_and_decided_but_never_used_by_a_real_run(
    sandbox, system_actor, operator, approver, client
):
    dry = _start(system_actor, LARGE_REFUND)
    assert dry.status == Run.Status.WAITING_APPROVAL
    dry_approval = Approval.objects.get(run=dry)
    # the approver is told what approving it does
    client.force_login(approver)
    page = client.get(reverse("approvals:detail", args=[dry_approval.id])).content.decode()
    assert "badge-dry-run" in page and "approving it sends nothing" in page
    _approve(dry_approval, approver)

    dry = drive(dry.id)

    assert dry.status == Run.Status.SUCCEEDED
    assert refund_posts(sandbox) == []
    dry_approval.refresh_from_db()
    assert dry_approval.consumed_at is not None  # by the simulated dispatch, and only it

    real = drive(run_promote(run_id=dry.id, actor=Actor.for_user(operator, "web")).id)

    # the same call with the same arguments: its approval is asked again, the dry run's
    # approved one is not used
    assert real.status == Run.Status.WAITING_APPROVAL
    real_approval = Approval.objects.get(run=real)
    assert real_approval.id != dry_approval.id
    assert real_approval.status == Approval.Status.PENDING
    assert refund_posts(sandbox) == []
    _approve(real_approval, approver)

    real = drive(real.id)

    assert real.status == Run.Status.SUCCEEDED
    (post,) = refund_posts(sandbox)
    assert post["idempotency_key"] == f"{real.id}:2"  # its own key, not the dry run's
    assert refunds(sandbox)[0]["amount_cents"] == LARGE_REFUND["amount_cents"]


def test_promotion_starts_the_same_input_for_real_linked_both_ways(sandbox, system_actor, operator):
    dry = _start(system_actor, SMALL_REFUND)

    real = run_promote(run_id=dry.id, actor=Actor.for_user(operator, "web"))

    assert real.dry_run is False
    assert (real.agent_name, real.input, real.goal) == (dry.agent_name, dry.input, dry.goal)
    assert real.promoted_from_id == dry.id and real.root_run_id == real.id
    assert real.principal == operator
    dry.refresh_from_db()
    assert dry.promoted_to == real
    (promoted,) = events(dry.id, "run.promoted")
    assert promoted.payload["to_run"] == str(real.id)
    assert promoted.actor == "user:olivia"
    assert events(real.id, "run.created")[0].payload["promoted_from"] == str(dry.id)
    # the agent decides afresh: none of the dry run's steps are carried over
    assert real.steps.count() == 0
    real = drive(real.id)
    assert real.status == Run.Status.SUCCEEDED
    assert real.result["refunded"] is True
    assert len(refund_posts(sandbox)) == 1


def test_promotion_is_refused_for_a_real_run_an_unfinished_one_and_a_second_time(
    sandbox, system_actor, operator
):
    actor = Actor.for_user(operator, "web")
    real = _start(system_actor, SMALL_REFUND, dry_run=False)
    with pytest.raises(InvalidState, match="only a dry run"), transaction.atomic():
        run_promote(run_id=real.id, actor=actor)

    waiting = _start(system_actor, LARGE_REFUND)
    with pytest.raises(InvalidState, match="once it has finished"), transaction.atomic():
        run_promote(run_id=waiting.id, actor=actor)

    dry = _start(system_actor, SMALL_REFUND)
    run_promote(run_id=dry.id, actor=actor)
    with pytest.raises(AlreadyPromoted), transaction.atomic():
        run_promote(run_id=dry.id, actor=actor)
    assert Run.objects.filter(promoted_from=dry).count() == 1


def test_a_fork_of_a_dry_run_is_a_dry_run(sandbox, system_actor, operator):
    dry = _start(system_actor, SMALL_REFUND)

    fork = drive(run_fork(run_id=dry.id, actor=Actor.for_user(operator, "web"), from_step=1).id)

    assert fork.dry_run is True
    assert events(fork.id, "run.created")[0].payload["dry_run"] is True
    assert fork.status == Run.Status.SUCCEEDED
    assert refund_posts(sandbox) == []


def test_startrun_starts_a_dry_run(register, capsys):
    from django.core.management import CommandError, call_command

    register(
        make_tool("dr_cli_write", CountingTool(), effect=Effect.UNSAFE),
        ScriptedAgent("dr_cli", lambda ctx: Finish(), tools=("dr_cli_write",)),
    )
    call_command(
        "startrun", "refund", "--input", '{"order_id": "ord_1", "amount_cents": 1}', "--dry-run"
    )
    run = Run.objects.get(id=capsys.readouterr().out.strip())
    assert run.dry_run is True
    with pytest.raises(CommandError, match="dr_cli_write"):
        call_command("startrun", "dr_cli", "--dry-run")


def _samples(name: str) -> dict[tuple, float]:
    from runs.metrics import collect_runs

    (family,) = [f for f in collect_runs() if f.name == name]
    names = (name, f"{name}_total")  # a counter's sample is named ..._total
    return {tuple(s.labels.values()): s.value for s in family.samples if s.name in names}


def test_metrics_count_dry_runs_apart_from_throughput(register, system_actor):
    tool = make_tool("dr_metric_write", CountingTool(), effect=Effect.IDEMPOTENT)
    tool.dry_run = lambda arguments, ctx: ToolResult(result={"would": "write"})

    def decide(ctx):
        return Finish() if ctx.steps else CallTool("dr_metric_write", {})

    register(tool, ScriptedAgent("dr_metric", decide, tools=("dr_metric_write",)))
    drive(run_create(agent_name="dr_metric", actor=system_actor, dry_run=True).id)
    drive(run_create(agent_name="dr_metric", actor=system_actor, dry_run=True).id)
    drive(run_create(agent_name="dr_metric", actor=system_actor).id)

    assert _samples("agentops_runs")[("succeeded",)] == 1
    assert _samples("agentops_dry_runs")[("succeeded",)] == 2
    assert _samples("agentops_steps")[()] == 2  # the real run's call and finish only


def test_the_audit_export_marks_a_dry_run_s_events(sandbox, system_actor):
    import json

    from django.core.management import call_command

    dry = _start(system_actor, SMALL_REFUND)
    real = _start(system_actor, SMALL_REFUND, dry_run=False)
    out = io.StringIO()

    call_command("audit_export", "--since", "2000-01-01", "--format", "jsonl", stdout=out)

    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    marks = {(row["run_id"], row["dry_run"]) for row in rows}
    assert marks == {(str(dry.id), True), (str(real.id), False)}
