"""Expiry that holds: each on-expiry action, applied by the sweep even when no worker ran
while the approval expired; reminders before expiry; the principal is told."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.core import mail
from django.test import Client
from django.utils import timezone

from approvals.models import Approval, ApprovalLink
from approvals.services import approvals_expire_due, approvals_remind_due
from runs import sweeper
from runs.models import Run, ToolCall
from runs.registry import ApprovalPolicy, CallTool, Effect, Finish, OnExpiry, registry
from runs.services import run_create
from tests.approvals.conftest import link, requested, token_for
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, events, make_tool, refund_posts

pytestmark = pytest.mark.usefixtures("roles")


def _expire(approval: Approval, seconds: float = 5) -> None:
    """As if the approval's time to live ran out ``seconds`` ago while nothing ran."""
    Approval.objects.filter(id=approval.id).update(
        expires_at=timezone.now() - timedelta(seconds=seconds)
    )


@pytest.fixture
def principal(operator):
    operator.email = "olivia@example.com"
    operator.save(update_fields=["email"])
    return operator


@pytest.mark.django_db
def test_reject_on_expiry_during_downtime_is_applied_by_the_sweep_and_the_agent_sees_it(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice, principal
):
    run, approval = requested(django_capture_on_commit_callbacks, system_actor, principal=principal)
    token = token_for("alice@example.com")
    mail.outbox.clear()
    _expire(approval, seconds=3600)  # no worker, no sweeper for an hour

    with django_capture_on_commit_callbacks(execute=True):
        sweeper.sweep()  # the first pass after recovery

    approval.refresh_from_db()
    assert approval.status == Approval.Status.EXPIRED
    call = ToolCall.objects.get(run=run, tool_name="refund_payment")
    assert (call.status, call.last_error) == (ToolCall.Status.REJECTED, "approval_expired")
    (expired,) = events(run.id, "approval.expired")
    assert (expired.actor, expired.payload["on_expiry"]) == ("system", "reject")
    (notice,) = mail.outbox
    assert notice.to == ["olivia@example.com"] and "expired" in notice.subject
    assert client.get(link(token)).status_code == 410

    run = drive(run.id)

    assert (run.status, run.reason_code) == (Run.Status.FAILED, "approval_expired")
    assert refund_posts(sandbox) == []
    assert approvals_expire_due() == 0  # applied once


@pytest.fixture
def policy_agent(register):
    """An agent whose one call needs approval under a policy the test chooses."""
    body = CountingTool()

    def install(policy: ApprovalPolicy) -> CountingTool:
        register(
            make_tool("pay_vendor", body, effect=Effect.IDEMPOTENT, approval=policy),
            ScriptedAgent(
                "payables",
                lambda ctx: (
                    Finish({"status": ctx.last_step.status})
                    if ctx.steps
                    else CallTool("pay_vendor", {"vendor": "v1"})
                ),
                tools=("pay_vendor",),
            ),
        )
        return body

    return install


@pytest.mark.django_db
def test_terminate_on_expiry_ends_the_run(
    django_capture_on_commit_callbacks, policy_agent, system_actor, alice
):
    body = policy_agent(ApprovalPolicy(when="always", on_expiry=OnExpiry.TERMINATE))
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(run_create(agent_name="payables", actor=system_actor).id)
    approval = Approval.objects.get(run=run)
    _expire(approval)

    assert approvals_expire_due() == 1

    run.refresh_from_db()
    assert (run.status, run.reason_code) == (Run.Status.TERMINATED, "approval_expired")
    assert ToolCall.objects.get(run=run).status == ToolCall.Status.CANCELLED
    approval.refresh_from_db()
    assert approval.status == Approval.Status.EXPIRED
    assert drive(run.id).status == Run.Status.TERMINATED
    assert body.calls == []


@pytest.mark.django_db
def test_escalate_on_expiry_asks_the_second_group_with_a_new_expiry_and_its_link_works(
    django_capture_on_commit_callbacks, policy_agent, system_actor, alice, django_user_model
):
    body = policy_agent(
        ApprovalPolicy(
            when="always", ttl_seconds=600, on_expiry=OnExpiry.ESCALATE, escalate_to="admin"
        )
    )
    boss = django_user_model.objects.create_user(
        username="erin", password="pw", email="erin@example.com"
    )
    boss.groups.add(Group.objects.get(name="admin"))
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(run_create(agent_name="payables", actor=system_actor).id)
    first = Approval.objects.get(run=run)
    alice_token = token_for("alice@example.com")
    assert not [m for m in mail.outbox if "erin@example.com" in m.to]
    _expire(first)

    with django_capture_on_commit_callbacks(execute=True):
        assert approvals_expire_due() == 1

    first.refresh_from_db()
    assert first.status == Approval.Status.CANCELLED
    second = Approval.objects.get(run=run, status=Approval.Status.PENDING)
    assert (second.approver_group, second.on_expiry) == ("admin", "reject")
    assert second.expires_at > timezone.now() + timedelta(seconds=590)
    requested_events = events(run.id, "approval.requested")
    assert requested_events[-1].payload["escalated_from"] == first.id
    client = Client()
    client.force_login(alice)
    expired = client.post(link(alice_token), {"decision": "approve", "confirm": "yes"})
    assert expired.status_code == 410

    erin = Client()
    erin.force_login(boss)
    response = erin.post(
        link(token_for("erin@example.com")), {"decision": "approve", "confirm": "yes"}
    )

    assert response.status_code == 200
    second.refresh_from_db()
    assert second.status == Approval.Status.APPROVED
    run = drive(run.id)
    assert run.result == {"status": "completed"}
    assert len(body.calls) == 1


@pytest.mark.django_db
def test_a_reminder_goes_out_once_before_expiry_with_a_fresh_link(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice, settings
):
    settings.AGENTOPS = {**settings.AGENTOPS, "APPROVAL_REMINDER_BEFORE": 3600}
    run, approval = requested(django_capture_on_commit_callbacks, system_actor)
    first_token = token_for("alice@example.com")
    assert approvals_remind_due() == 0  # 24 hours left: not yet
    # 23.5 hours later: half an hour left
    Approval.objects.filter(id=approval.id).update(
        requested_at=approval.requested_at - timedelta(hours=23, minutes=30),
        expires_at=timezone.now() + timedelta(minutes=30),
    )
    mail.outbox.clear()

    with django_capture_on_commit_callbacks(execute=True):
        assert approvals_remind_due() == 1
        assert approvals_remind_due() == 0

    (reminder,) = mail.outbox
    assert reminder.to == ["alice@example.com"]
    assert reminder.subject.startswith("Reminder")
    second_token = token_for("alice@example.com")
    assert second_token != first_token
    assert ApprovalLink.objects.filter(approval=approval, kind="reminder").count() == 1
    (sent,) = [e for e in events(run.id, "approval.email_sent") if e.payload["kind"] == "reminder"]
    assert sent.payload["to"] == "alice"

    client.force_login(alice)
    decided = client.post(link(second_token), {"decision": "approve", "confirm": "yes"})
    assert decided.status_code == 200
    approval.refresh_from_db()
    assert approval.status == Approval.Status.APPROVED
    assert client.get(link(first_token)).status_code == 200  # shows the decision


@pytest.mark.django_db
def test_short_lived_approvals_get_no_reminder(
    django_capture_on_commit_callbacks, policy_agent, system_actor, alice, settings
):
    settings.AGENTOPS = {**settings.AGENTOPS, "APPROVAL_REMINDER_BEFORE": 3600}
    policy_agent(ApprovalPolicy(when="always", ttl_seconds=600))
    with django_capture_on_commit_callbacks(execute=True):
        drive(run_create(agent_name="payables", actor=system_actor).id)

    assert approvals_remind_due() == 0


@pytest.mark.django_db
def test_escalation_follows_the_policy_copied_onto_the_approval_not_a_later_deploy(
    policy_agent, system_actor, django_user_model
):
    policy_agent(
        ApprovalPolicy(
            when="always", ttl_seconds=600, on_expiry=OnExpiry.ESCALATE, escalate_to="admin"
        )
    )
    run = drive(run_create(agent_name="payables", actor=system_actor).id)
    first = Approval.objects.get(run=run)
    # a deploy changes the policy while the approval waits
    registry.tool("pay_vendor").approval = ApprovalPolicy(
        when="always", ttl_seconds=60, on_expiry=OnExpiry.ESCALATE, escalate_to="operator"
    )
    _expire(first)

    assert approvals_expire_due() == 1

    second = Approval.objects.get(run=run, status=Approval.Status.PENDING)
    assert second.approver_group == "admin"
    assert second.expires_at > timezone.now() + timedelta(seconds=590)
    first.refresh_from_db()
    assert first.reason == "escalated to admin"
