"""Clicks counted (issue 21 item 8): the tasks people come to the console for, as a signed-in
approver who is not the run's principal, with role and label selectors only. Typing is not a
click; pressing Enter to submit counts as one."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Group
from django.urls import reverse

from approvals.models import Approval
from runs.actors import Actor
from runs.models import RunEvent, ToolCall
from runs.services import run_create
from tests.browser.conftest import PASSWORD, shot, sign_in
from tests.browser.test_console import followup_with_a_lost_notification
from tests.conftest import drive

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


class Clicks:
    """Every click (and Enter) of a task goes through here, so the test counts them."""

    def __init__(self) -> None:
        self.count = 0

    def click(self, locator) -> None:
        self.count += 1
        locator.click()

    def enter(self, locator) -> None:
        self.count += 1
        locator.press("Enter")


@pytest.fixture
def demo_principal(roles, django_user_model):
    """The run's principal: the demo's operator account that starts the runs."""
    user = django_user_model.objects.create_user(username="demo", password=PASSWORD)
    user.groups.add(Group.objects.get(name="operator"))
    return user


@pytest.fixture
def dana(roles, django_user_model):
    """An approver on call (and operator, to resolve calls) who did not start the runs."""
    user = django_user_model.objects.create_user(username="dana", password=PASSWORD)
    user.groups.add(*Group.objects.filter(name__in=["approver", "operator"]))
    return user


def _expect():
    from playwright.sync_api import expect

    return expect


def test_approve_the_demo_refund_from_the_dashboard_in_two_clicks(
    page, demo_principal, dana, sandbox
):
    expect = _expect()
    run = run_create(
        agent_name="refund",
        goal="Refund order 1004: never delivered",
        input={"order_id": "ord_1004", "amount_cents": 250_000},
        actor=Actor.for_user(demo_principal, "web"),
    )
    run = drive(run.id)
    approval = Approval.objects.get(run=run)
    assert run.principal_id == demo_principal.id
    sign_in(page, "dana")
    page.goto(reverse("runs:dashboard"))
    clicks = Clicks()

    # the badge in the navigation counts what the dashboard lists
    badge = page.get_by_role("navigation", name="Main").get_by_role(
        "link", name=re.compile("Needs you")
    )
    expect(badge).to_contain_text("1")
    needs_you = page.get_by_role("region", name=re.compile("Needs you"))
    expect(needs_you.get_by_role("listitem")).to_have_count(1)
    clicks.click(needs_you.get_by_role("link", name="Refund 2,500.00 EUR to order ord_1004"))
    expect(page.get_by_role("cell", name="2,500.00 EUR").first).to_be_visible()
    clicks.click(page.get_by_role("button", name="Approve", exact=True))
    expect(page.get_by_text("You approved this call.")).to_be_visible()
    shot(page, "clicks-approved")

    assert clicks.count <= 2
    approval.refresh_from_db()
    assert approval.status == Approval.Status.APPROVED
    decided = RunEvent.objects.get(run=run, type="approval.decided")
    assert (decided.actor, decided.channel) == ("user:dana", "web")


def test_resolve_an_unknown_outcome_in_three_clicks(
    page, demo_principal, dana, sandbox, monkeypatch
):
    expect = _expect()
    run, call, sent = followup_with_a_lost_notification(monkeypatch, sandbox, demo_principal)
    sign_in(page, "dana")
    page.goto(reverse("runs:dashboard"))
    clicks = Clicks()

    clicks.click(page.get_by_role("link", name=re.compile("Resolve the unknown outcome of")))
    card = page.locator(f"#call-{call.id}")
    card.get_by_label("External reference").fill(sent["notification_id"])
    clicks.click(card.get_by_role("button", name="Mark as happened"))
    expect(card).to_contain_text(re.compile(r"is now\s+succeeded"))

    assert clicks.count <= 3
    call.refresh_from_db()
    assert call.status == ToolCall.Status.SUCCEEDED
    resolved = RunEvent.objects.get(run=run, type="tool.resolved")
    assert resolved.actor == "user:dana"


def test_find_a_run_by_its_order_id_in_two_clicks(page, demo_principal, dana, sandbox):
    expect = _expect()
    wanted = run_create(
        agent_name="refund",
        goal="Refund order 1004: never delivered",
        input={"order_id": "ord_1004", "amount_cents": 500},
        actor=Actor.for_user(demo_principal, "web"),
    )
    run_create(
        agent_name="refund",
        goal="Refund order 1001: wrong size",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=Actor.for_user(demo_principal, "web"),
    )
    sign_in(page, "dana")
    page.goto(reverse("runs:dashboard"))
    clicks = Clicks()

    search = page.get_by_role("searchbox", name="Find runs")
    search.fill("ord_1004")
    clicks.enter(search)
    clicks.click(page.get_by_role("link", name=re.compile("Refund order 1004")))
    expect(page).to_have_url(re.compile(reverse("runs:detail", args=[wanted.id])))

    assert clicks.count <= 2


def test_approve_two_refunds_at_once_after_seeing_each(page, demo_principal, dana, sandbox):
    """Airflow's Required Actions, bettered: select two refunds in the inbox, see each call's
    summary and arguments on the confirmation page, approve both — each decided on its own."""
    expect = _expect()
    runs = []
    for order, cents in (("ord_1004", 250_000), ("ord_1008", 99_900)):
        run = run_create(
            agent_name="refund",
            goal=f"Refund order {order[-4:]}",
            input={"order_id": order, "amount_cents": cents},
            actor=Actor.for_user(demo_principal, "web"),
        )
        runs.append(drive(run.id))
    sign_in(page, "dana")
    page.goto(reverse("approvals:inbox"))
    page.get_by_label("Select Refund 2,500.00 EUR to order ord_1004").check()
    page.get_by_label("Select Refund 999.00 EUR to order ord_1008").check()
    page.get_by_role("button", name="Approve selected…").click()
    expect(page.get_by_role("heading", name="Approve 2 calls?")).to_be_visible()
    expect(page.get_by_text("Refund 2,500.00 EUR to order ord_1004")).to_be_visible()
    expect(page.get_by_text("Refund 999.00 EUR to order ord_1008")).to_be_visible()
    shot(page, "approvals-bulk-review", doc="approvals-bulk")
    page.get_by_role("button", name="Approve 2 calls").click()
    expect(page.get_by_role("heading", name="Decisions")).to_be_visible()
    for run in runs:
        assert Approval.objects.get(run=run).status == Approval.Status.APPROVED


def test_triage_lists_each_unknown_outcome_with_its_latest_lookup(
    page, demo_principal, dana, sandbox, monkeypatch
):
    expect = _expect()
    run, call, _sent = followup_with_a_lost_notification(monkeypatch, sandbox, demo_principal)
    sign_in(page, "dana")
    page.goto(reverse("runs:unknown_triage"))
    expect(page.get_by_role("heading", name="Triage unknown outcomes")).to_be_visible()
    expect(page.get_by_role("button", name="Resolve selected")).to_be_visible()
    expect(page.locator("main")).to_contain_text(call.tool_name)
    shot(page, "unknown-triage", doc="triage")
