"""Approval policies as versioned data (issue 23, items 1 and 2): rules in CEL validated when
written, evaluated in order (allow / deny / require approval), versions that are never
edited, publishing by a second person, the current version re-checked at the dispatch and
every pending approval re-checked when a version is published."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import transaction

from approvals import policies
from approvals.models import (
    Approval,
    ApprovalPolicyVersion,
    ImmutableVersion,
)
from approvals.policy_services import (
    PolicyConflict,
    PolicyInvalid,
    SeparationOfDuties,
    policy_version_draft,
    policy_version_publish,
)
from approvals.services import approval_decide
from runs.actors import Actor, PermissionDenied
from runs.models import Run, RunEvent, Step, ToolCall
from runs.services import run_create
from tests.conftest import _user_in, drive
from tests.support import events, refund_posts

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

SCHEMA = {
    "type": "object",
    "properties": {"order_id": {"type": "string"}, "amount_cents": {"type": "integer"}},
}
FACTS = {
    "principal": "svc",
    "groups": ["operator"],
    "agent": "refund",
    "spend": "0.25",
    "at": "2026-12-01T08:30:00+00:00",
}
TWO_ABOVE_50 = [
    {
        "when": "args.amount_cents > 5000",
        "decide": "require_approval",
        "approval": {"group": "approver", "required": 2},
    }
]


def _eval(rules, arguments, facts=FACTS, tz="UTC"):
    return policies.evaluate(rules, arguments=arguments, facts=facts, tool="t", time_zone=tz)


def _errors(rules, tz="UTC"):
    return policies.validate(
        rules, time_zone=tz, tool_schema=SCHEMA, groups={"approver", "operator", "finance"}
    )


# --- evaluation ------------------------------------------------------------------------------


def test_the_first_matching_rule_decides_and_no_match_allows():
    rules = [
        {"when": "args.amount_cents > 100000", "decide": "deny", "reason": "too large"},
        {"when": "args.amount_cents > 5000", "decide": "require_approval"},
    ]
    assert _eval(rules, {"amount_cents": 200000}).decision == "deny"
    assert _eval(rules, {"amount_cents": 200000}).reason == "too large"
    needs = _eval(rules, {"amount_cents": 6000})
    assert (needs.decision, needs.rule, needs.requirement.required) == ("require_approval", 2, 1)
    assert _eval(rules, {"amount_cents": 100}).decision == "allow"


def test_rules_read_principal_spend_and_time_of_day_in_the_policys_zone():
    rule = [
        {
            "when": '"operator" in principal.groups && spend > 0.2 && now.hour >= 9',
            "decide": "deny",
        }
    ]
    # 08:30 UTC is 09:30 in Paris
    assert _eval(rule, {}, tz="UTC").decision == "allow"
    assert _eval(rule, {}, tz="Europe/Paris").decision == "deny"
    assert _eval(rule, {}, facts={**FACTS, "spend": "0.1"}, tz="Europe/Paris").decision == "allow"


def test_a_rule_that_fails_on_a_real_call_fails_closed():
    deny = [{"when": "args.missing > 1", "decide": "deny"}]
    allow = [{"when": "args.missing > 1", "decide": "allow"}, {"decide": "require_approval"}]
    assert _eval(deny, {}).decision == "deny"
    assert _eval(deny, {}).error.startswith("no field 'missing'")
    assert _eval(allow, {}).decision == "require_approval"


# --- validation ------------------------------------------------------------------------------


def test_validation_names_each_problem_clearly():
    errors = _errors(
        [
            {"when": "args.amount_cents >", "decide": "allow"},
            {"when": "args.amount > 5000", "decide": "deny"},
            {"when": "args.amount_cents > 50.00", "decide": "deny"},
            {"when": "user.name == 'x'", "decide": "deny"},
            {"when": "args.amount_cents", "decide": "deny"},
            {"decide": "maybe"},
            {
                "decide": "require_approval",
                "approval": {"group": "nobody", "required": 2, "bearer_links": True},
            },
        ],
        tz="Mars/Olympus",
    )
    assert errors["time_zone"] == [
        "unknown time zone 'Mars/Olympus' (an IANA name such as Europe/Paris)"
    ]
    assert errors["rule 1"][0].startswith("syntax error")
    assert errors["rule 2"] == [
        "args has no field 'amount'; the tool's arguments are amount_cents, order_id"
    ]
    assert "compare integers with integers" in errors["rule 3"][0]
    assert errors["rule 4"][0].startswith("unknown name 'user'")
    assert errors["rule 5"] == ["the expression must be true or false"]
    assert errors["rule 6"] == ["decide must be one of allow, deny, require_approval"]
    assert "no group named 'nobody'" in errors["rule 7"]
    assert any("1-of-1 approvals only" in e for e in errors["rule 7"])
    assert _errors(TWO_ABOVE_50) == {}


def test_an_invalid_draft_writes_nothing(admin_user_a):
    with pytest.raises(PolicyInvalid) as info:
        policy_version_draft(
            actor=Actor.for_user(admin_user_a, "web"),
            tool_name="refund_payment",
            rules=[{"when": "args.amount > 1", "decide": "deny"}],
            note="",
        )
    assert set(info.value.fields) == {"rule 1", "note"}
    assert not ApprovalPolicyVersion.objects.exists()


# --- versions --------------------------------------------------------------------------------


@pytest.fixture
def admin_user_a(django_user_model):
    return _user_in(django_user_model, "ada", "admin")


@pytest.fixture
def admin_user_b(django_user_model):
    return _user_in(django_user_model, "bea", "admin")


def draft(user, rules=TWO_ABOVE_50, note="above 50.00 needs two", **kw):
    return policy_version_draft(
        actor=Actor.for_user(user, "web"),
        tool_name="refund_payment",
        rules=rules,
        note=note,
        **kw,
    )


def publish(user, version):
    return policy_version_publish(actor=Actor.for_user(user, "web"), version_id=version.id)


def test_every_change_is_a_new_version_and_none_is_ever_edited(admin_user_a, admin_user_b):
    first = draft(admin_user_a)
    publish(admin_user_b, first)
    second = draft(admin_user_a, rules=[], note="no approvals at all")
    assert (first.number, second.number, second.based_on_id) == (1, 2, first.id)
    first.refresh_from_db()
    first.rules = []
    with pytest.raises(ImmutableVersion):
        first.save()
    with pytest.raises(ImmutableVersion):
        first.save(update_fields=["rules"])
    publish(admin_user_b, second)
    first.refresh_from_db()
    assert first.status == "superseded" and first.rules == TWO_ABOVE_50
    from runs.models import AuditEntry

    actions = list(AuditEntry.objects.order_by("id").values_list("action", "actor"))
    assert actions == [
        ("policy.drafted", "user:ada"),
        ("policy.published", "user:bea"),
        ("policy.drafted", "user:ada"),
        ("policy.published", "user:bea"),
    ]


def test_the_drafter_cannot_publish_and_only_admins_manage(admin_user_a, operator):
    version = draft(admin_user_a)
    with pytest.raises(SeparationOfDuties), transaction.atomic():
        publish(admin_user_a, version)
    with pytest.raises(PermissionDenied), transaction.atomic():
        draft(operator)
    version.refresh_from_db()
    assert version.status == "draft"


def test_a_draft_written_against_an_older_version_is_refused(admin_user_a, admin_user_b):
    stale = draft(admin_user_a, note="one idea")
    other = draft(admin_user_b, rules=[], note="another idea")
    publish(admin_user_a, other)
    with pytest.raises(PolicyConflict), transaction.atomic():
        publish(admin_user_b, stale)


# --- the engine ------------------------------------------------------------------------------


def _refund(system_actor, amount):
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1004", "amount_cents": amount},
        actor=system_actor,
    )
    return drive(run.id)


def test_without_a_data_policy_the_code_policy_decides(sandbox, system_actor):
    run = _refund(system_actor, 6000)  # 60.00: under the code policy's 100.00
    assert run.status == Run.Status.SUCCEEDED
    call = ToolCall.objects.get(run=run, tool_name="refund_payment")
    assert set(call.policy_input) == {"principal", "groups", "agent", "spend", "at"}
    assert call.policy_input["agent"] == "refund"


def test_a_published_policy_requires_two_approvers_and_each_approval_names_its_version(
    sandbox, system_actor, admin_user_a, admin_user_b, approver, second_approver
):
    version, _ = publish(admin_user_b, draft(admin_user_a))
    run = _refund(system_actor, 6000)
    assert run.status == Run.Status.WAITING_APPROVAL
    approval = Approval.objects.get(run=run)
    assert (approval.required_count, approval.policy_version_id) == (2, version.id)
    (requested,) = events(run.id, "approval.requested")
    assert requested.payload["policy_version"] == version.id
    for user in (approver, second_approver):
        approval_decide(
            approval_id=approval.id, decision="approve", actor=Actor.for_user(user, "web")
        )
    assert drive(run.id).status == Run.Status.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1


def test_a_deny_rule_fails_the_step_with_the_reason_the_agent_sees(
    sandbox, system_actor, admin_user_a, admin_user_b
):
    rules = [{"when": "args.amount_cents > 5000", "decide": "deny", "reason": "ask finance"}]
    publish(admin_user_b, draft(admin_user_a, rules=rules))
    run = _refund(system_actor, 6000)
    step = Step.objects.get(run=run, seq=2)
    assert step.status == "failed"
    assert step.error == "denied by policy: ask finance"
    assert step.input["arguments"]["customer_email"] == "***"
    assert not Approval.objects.filter(run=run).exists()
    assert refund_posts(sandbox) == []


def test_publishing_a_stricter_version_re_requests_a_pending_approval(
    sandbox, system_actor, admin_user_a, admin_user_b, approver
):
    run = _refund(system_actor, 50_000)  # code policy: one approver
    old = Approval.objects.get(run=run)
    approval_decide(
        approval_id=old.id,
        decision="comment",
        comment="looking",
        actor=Actor.for_user(approver, "web"),
    )
    version, done = publish(admin_user_b, draft(admin_user_a))
    old.refresh_from_db()
    assert old.status == "cancelled" and old.reason.startswith("policy_changed")
    new = Approval.objects.get(run=run, status="pending")
    assert (new.required_count, new.policy_version_id) == (2, version.id)
    assert done.rerequested == [new.id]
    cancelled = events(run.id, "approval.cancelled")[-1]
    assert cancelled.payload["reason"] == "policy_changed"
    assert cancelled.actor == "user:bea"
    assert Run.objects.get(id=run.id).status == Run.Status.WAITING_APPROVAL


def test_a_looser_version_never_approves_a_pending_call(
    sandbox, system_actor, admin_user_a, admin_user_b
):
    run = _refund(system_actor, 50_000)
    _, done = publish(admin_user_b, draft(admin_user_a, rules=[], note="allow everything"))
    approval = Approval.objects.get(run=run)
    assert approval.status == "pending" and done.still_pending == [approval.id]
    assert drive(run.id).status == Run.Status.WAITING_APPROVAL
    assert refund_posts(sandbox) == []


def test_a_version_that_denies_rejects_a_pending_call(
    sandbox, system_actor, admin_user_a, admin_user_b
):
    run = _refund(system_actor, 50_000)
    rules = [{"when": "args.amount_cents > 10000", "decide": "deny", "reason": "too large"}]
    _, done = publish(admin_user_b, draft(admin_user_a, rules=rules))
    assert len(done.denied) == 1
    assert ToolCall.objects.get(run=run, tool_name="refund_payment").status == "rejected"
    run = drive(run.id)
    assert "denied by policy: too large" in Step.objects.get(run=run, seq=2).error
    assert refund_posts(sandbox) == []


# the engine's checkpoint refuses without a savepoint (it is never nested in production):
# a test transaction around it would be left broken
@pytest.mark.django_db(transaction=True)
def test_the_dispatch_withdraws_an_approval_the_current_version_is_not_met_by(
    sandbox, system_actor, admin_user_a, admin_user_b, approver, second_approver
):
    run = _refund(system_actor, 50_000)
    approval = Approval.objects.get(run=run)
    approval_decide(
        approval_id=approval.id, decision="approve", actor=Actor.for_user(approver, "web")
    )
    # approved under one approver, not yet dispatched; now two are needed
    version, done = publish(admin_user_b, draft(admin_user_a))
    assert done.rerequested == []
    run = drive(run.id)
    assert run.status == Run.Status.WAITING_APPROVAL
    assert refund_posts(sandbox) == []
    approval.refresh_from_db()
    assert approval.status == "cancelled" and approval.consumed_at is None
    assert approval.reason == "policy_changed"
    again = Approval.objects.get(run=run, status="pending")
    assert (again.required_count, again.policy_version_id) == (2, version.id)
    for user in (approver, second_approver):
        approval_decide(approval_id=again.id, decision="approve", actor=Actor.for_user(user, "web"))
    assert drive(run.id).status == Run.Status.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1


# the engine's checkpoint refuses without a savepoint (it is never nested in production):
# a test transaction around it would be left broken
@pytest.mark.django_db(transaction=True)
def test_the_dispatch_denies_an_approved_call_the_current_version_denies(
    sandbox, system_actor, admin_user_a, admin_user_b, approver
):
    run = _refund(system_actor, 50_000)
    approval = Approval.objects.get(run=run)
    approval_decide(
        approval_id=approval.id, decision="approve", actor=Actor.for_user(approver, "web")
    )
    rules = [{"decide": "deny", "reason": "refunds are frozen"}]
    publish(admin_user_b, draft(admin_user_a, rules=rules, note="freeze"))
    run = drive(run.id)
    assert refund_posts(sandbox) == []
    assert Step.objects.get(run=run, seq=2).error == "denied by policy: refunds are frozen"
    assert ToolCall.objects.get(run=run, tool_name="refund_payment").status == "cancelled"
    approval.refresh_from_db()
    assert approval.status == "cancelled" and approval.reason == "policy_denied"
    assert RunEvent.objects.filter(run=run, type="tool.cancelled").exists()


def test_a_scoped_policy_wins_over_the_tools_own(sandbox, system_actor, admin_user_a, admin_user_b):
    publish(admin_user_b, draft(admin_user_a, rules=[], note="allow"))
    publish(
        admin_user_b,
        draft(
            admin_user_a,
            rules=[{"decide": "deny", "reason": "not for this agent"}],
            note="refund agent may not refund",
            agent_name="refund",
        ),
    )
    run = _refund(system_actor, 100)
    assert Step.objects.get(run=run, seq=2).error == "denied by policy: not for this agent"


def test_facts_time_is_recorded_timezone_aware(sandbox, system_actor):
    run = _refund(system_actor, 100)
    call = ToolCall.objects.get(run=run, tool_name="refund_payment")
    at = datetime.fromisoformat(call.policy_input["at"])
    assert at.tzinfo is not None and at <= datetime.now(UTC)
