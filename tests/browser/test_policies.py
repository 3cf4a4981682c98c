"""The approval policy change of issue 23, as a user does it in the console: one admin drafts
"refunds above 50.00 need two approvers", simulates it against history and sees which calls
change; a second admin publishes it, and the refund waiting for one approver is asked again
for two."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Group
from django.urls import reverse

from approvals.models import Approval, ApprovalPolicyVersion
from runs.actors import Actor
from runs.services import run_create
from tests.browser.conftest import PASSWORD, shot, sign_in
from tests.conftest import drive

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def admins(roles, django_user_model):
    made = []
    for name in ("ada", "bea"):
        user = django_user_model.objects.create_user(username=name, password=PASSWORD)
        user.groups.add(*Group.objects.filter(name__in=["admin", "viewer"]))
        made.append(user)
    return made


def test_draft_simulate_and_publish_a_stricter_refund_policy(page, admins, sandbox):
    from playwright.sync_api import expect

    actor = Actor.system("cli")
    for amount in (500, 6_000):  # 5.00 and 60.00: dispatched under the code policy
        drive(
            run_create(
                agent_name="refund",
                input={"order_id": "ord_1004", "amount_cents": amount},
                actor=actor,
            ).id
        )
    waiting = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1004", "amount_cents": 20_000},
            actor=actor,
        ).id
    )
    first = Approval.objects.get(run=waiting)
    assert first.required_count == 1

    sign_in(page, "ada")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Policies").click()
    row = page.get_by_role("row", name=re.compile("refund_payment"))
    expect(row).to_contain_text("refunds above 100.00")
    row.get_by_role("link", name="Write a policy").click()

    rule = page.get_by_role("group", name="Rule 1")
    rule.get_by_label("When (CEL)").fill("args.amount_cents > 50.00")
    rule.get_by_label("Decision", exact=True).select_option("require_approval")
    rule.get_by_label("Approvers from", exact=True).select_option("approver")
    rule.get_by_label("Approvers needed").fill("2")
    page.get_by_label("Why (recorded with the version)").fill("refunds above 50.00 need two")
    page.get_by_role("button", name="Save the draft").click()
    # a type mistake is caught on its rule, and nothing is saved
    expect(page.get_by_role("group", name="Rule 1")).to_contain_text("compare integers")
    assert not ApprovalPolicyVersion.objects.exists()
    page.get_by_role("group", name="Rule 1").get_by_label("When (CEL)").fill(
        "args.amount_cents > 5000"
    )
    page.get_by_role("button", name="Save the draft").click()
    expect(page.get_by_role("heading", name=re.compile("Version 1"))).to_be_visible()
    expect(page.get_by_text("You drafted this version")).to_be_visible()

    page.get_by_role("button", name="Simulate").click()
    simulation = page.locator("#simulation")
    expect(simulation.locator('li[data-change="newly_requires_approval"]')).to_contain_text("1")
    expect(simulation.locator('li[data-change="requirement_changed"]')).to_contain_text("1")
    expect(
        simulation.get_by_role("row", name=re.compile("2 approvers from approver"))
    ).to_have_count(2)
    simulation.scroll_into_view_if_needed()
    shot(page, "policy-simulated", doc="policy-simulation")

    page.get_by_role("button", name="Sign out").click()
    sign_in(page, "bea")
    version = ApprovalPolicyVersion.objects.get()
    page.goto(reverse("approvals:policy_version", args=[version.id]))
    expect(page.locator("#diff")).to_contain_text("args.amount_cents > 5000")
    page.get_by_role("button", name="Publish version 1").click()
    expect(page.get_by_role("status").first).to_contain_text("1 pending approval(s) asked again")
    shot(page, "policy-published", doc="policy")

    first.refresh_from_db()
    assert first.status == "cancelled"
    again = Approval.objects.get(run=waiting, status="pending")
    assert (again.required_count, again.policy_version_id) == (2, version.id)
    page.goto(reverse("runs:detail", args=[waiting.id]))
    expect(page.locator("body")).to_contain_text("policy_changed")
    # the new request says what it replaced and that nobody's decision carried over
    page.goto(reverse("approvals:detail", args=[again.id]))
    expect(page.locator("#decision-panel")).to_contain_text("Asked again")
    expect(page.locator("#decision-panel")).to_contain_text(f"approval {first.id}")
    expect(page.locator(".quorum")).to_contain_text("2 approvers from approver")
