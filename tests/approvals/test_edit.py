"""Approve with edited arguments, and comments that decide nothing."""

from __future__ import annotations

import pytest
from django.db import transaction

from approvals.models import Approval, ApprovalDecision
from approvals.services import AlreadyDecided, InvalidArguments, approval_decide
from runs.actors import Actor
from runs.models import Run, ToolCall
from runs.registry import digest
from tests.approvals.conftest import CUSTOMER_EMAIL, start_refund
from tests.conftest import drive
from tests.support import events, refund_posts, refunds

pytestmark = pytest.mark.usefixtures("roles")


def _decide(approval, user, decision="approve", **kw):
    return approval_decide(
        approval_id=approval.id, decision=decision, actor=Actor.for_user(user, "web"), **kw
    )


def _state(run: Run) -> tuple:
    call = ToolCall.objects.get(run=run, tool_name="refund_payment")
    approval = Approval.objects.get(run=run)
    run.refresh_from_db()
    return (
        call.arguments,
        call.arguments_digest,
        approval.arguments_digest,
        approval.status,
        run.event_seq,
        ApprovalDecision.objects.filter(approval=approval).count(),
    )


@pytest.mark.django_db
def test_approving_edited_arguments_refunds_the_edit_once_and_keeps_the_original(
    sandbox, system_actor, approver, second_approver
):
    run = start_refund(system_actor)
    approval = Approval.objects.get(run=run)
    original = ToolCall.objects.get(run=run, tool_name="refund_payment")
    edit = dict(approval.arguments_masked, amount_cents=20_000)  # customer_email stays "***"

    _decide(approval, approver, edited_arguments=edit, comment="partial refund only")

    call = ToolCall.objects.get(id=original.id)
    assert call.arguments == {**original.arguments, "amount_cents": 20_000}
    assert call.arguments["customer_email"] == CUSTOMER_EMAIL  # "***" kept the hidden value
    assert call.arguments_digest == digest(call.arguments) != original.arguments_digest
    approval.refresh_from_db()
    assert approval.arguments_digest == call.arguments_digest
    assert approval.arguments_masked["amount_cents"] == 20_000
    (decision,) = approval.decisions.all()
    assert decision.original_arguments["amount_cents"] == 50_000
    assert decision.edited_arguments["amount_cents"] == 20_000
    assert decision.original_arguments["customer_email"] == "***"
    assert decision.edited_arguments["customer_email"] == "***"
    assert (decision.original_digest, decision.edited_digest) == (
        original.arguments_digest,
        call.arguments_digest,
    )
    (event,) = events(run.id, "approval.decided")
    assert event.payload["edited"] is True
    assert event.payload["original_arguments"]["amount_cents"] == 50_000
    assert event.payload["edited_arguments"]["amount_cents"] == 20_000
    assert CUSTOMER_EMAIL not in str(event.payload)
    # the edit counts as its author's approval; one more person approves what was changed
    assert (event.payload["required"], event.payload["settled"]) == (2, False)
    assert drive(run.id).status == Run.Status.WAITING_APPROVAL
    assert refund_posts(sandbox) == []

    _decide(approval, second_approver, comment="agreed")
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1
    (refund,) = refunds(sandbox)
    assert refund["amount_cents"] == 20_000
    approval.refresh_from_db()
    assert approval.consumed_at is not None


@pytest.mark.parametrize(
    "edit",
    [
        {"order_id": "ord_1004", "amount_cents": "lots"},
        {"order_id": "ord_1004", "amount_cents": 0},
        {"order_id": "ord_1004", "amount_cents": 100, "bcc": "me@example.com"},
        {"amount_cents": 100},
        ["not", "an", "object"],
    ],
)
@pytest.mark.django_db
def test_edited_arguments_that_fail_the_schema_change_nothing(
    sandbox, system_actor, approver, edit
):
    run = start_refund(system_actor)
    approval = Approval.objects.get(run=run)
    before = _state(run)

    with pytest.raises(InvalidArguments) as info, transaction.atomic():
        _decide(approval, approver, edited_arguments=edit)

    assert info.value.code == "validation_error"
    assert info.value.errors
    assert _state(run) == before


@pytest.mark.django_db
def test_edits_only_come_with_an_approval(sandbox, system_actor, approver):
    run = start_refund(system_actor)
    approval = Approval.objects.get(run=run)
    before = _state(run)

    with pytest.raises(InvalidArguments), transaction.atomic():
        _decide(approval, approver, "reject", comment="no", edited_arguments={"amount_cents": 1})

    assert _state(run) == before


@pytest.mark.django_db
def test_an_edit_that_changes_nothing_is_a_plain_approval(sandbox, system_actor, approver):
    run = start_refund(system_actor)
    approval = Approval.objects.get(run=run)
    digest_before = approval.arguments_digest

    _decide(approval, approver, edited_arguments=dict(approval.arguments_masked))

    approval.refresh_from_db()
    (decision,) = approval.decisions.all()
    assert decision.edited_arguments is None
    assert approval.arguments_digest == digest_before
    assert approval.status == Approval.Status.APPROVED


@pytest.mark.django_db
def test_an_edit_below_the_threshold_still_dispatches_once(
    sandbox, system_actor, approver, second_approver
):
    run = start_refund(system_actor)
    approval = Approval.objects.get(run=run)

    _decide(approval, approver, edited_arguments=dict(approval.arguments_masked, amount_cents=500))
    _decide(approval, second_approver)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    (refund,) = refunds(sandbox)
    assert refund["amount_cents"] == 500


@pytest.mark.django_db
def test_a_comment_decides_nothing_and_the_commenter_may_still_decide(
    sandbox, system_actor, approver
):
    run = start_refund(system_actor)
    approval = Approval.objects.get(run=run)

    _decide(approval, approver, "comment", comment="checking with finance")

    approval.refresh_from_db()
    run.refresh_from_db()
    assert (approval.status, run.status) == (Approval.Status.PENDING, Run.Status.WAITING_APPROVAL)
    (commented,) = events(run.id, "approval.commented")
    assert commented.payload["comment"] == "checking with finance"
    assert events(run.id, "approval.decided") == []

    _decide(approval, approver, comment="finance agrees")

    approval.refresh_from_db()
    assert approval.status == Approval.Status.APPROVED
    assert list(approval.decisions.values_list("decision", flat=True)) == ["comment", "approve"]
    with pytest.raises(AlreadyDecided), transaction.atomic():
        _decide(approval, approver, "comment", comment="too late")


@pytest.mark.django_db
def test_others_approvals_cannot_be_carried_over_to_an_edit(
    register, system_actor, approver, second_approver
):
    from runs.registry import ApprovalPolicy, CallTool, Effect, Finish
    from runs.services import run_create
    from tests.support import CountingTool, ScriptedAgent, make_tool

    body = CountingTool()
    register(
        make_tool(
            "wire",
            body,
            effect=Effect.IDEMPOTENT,
            schema={"type": "object", "properties": {"amount": {"type": "integer"}}},
            approval=ApprovalPolicy(when="always", required=2),
        ),
        ScriptedAgent(
            "payer",
            lambda ctx: Finish({}) if ctx.steps else CallTool("wire", {"amount": 10}),
            tools=("wire",),
        ),
    )
    run = drive(run_create(agent_name="payer", actor=system_actor).id)
    approval = Approval.objects.get(run=run)
    _decide(approval, approver)
    before = _state_generic(run)

    with pytest.raises(InvalidArguments, match="already approved"), transaction.atomic():
        _decide(approval, second_approver, edited_arguments={"amount": 99})

    assert _state_generic(run) == before


def _state_generic(run):
    call = ToolCall.objects.get(run=run)
    return (call.arguments_digest, Approval.objects.get(run=run).arguments_digest)
