"""The approvals pages: inbox, detail with the decision form, permissions, CSRF."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from approvals.models import Approval, ApprovalDecision
from runs.models import ToolCall
from tests.approvals.conftest import CUSTOMER_EMAIL, start_refund
from tests.support import events

pytestmark = pytest.mark.usefixtures("roles")


def _detail(approval) -> str:
    return reverse("approvals:detail", args=[approval.id])


def _decide(approval) -> str:
    return reverse("approvals:decide", args=[approval.id])


@pytest.fixture
def waiting(sandbox, system_actor):
    run = start_refund(system_actor)
    return Approval.objects.get(run=run)


@pytest.mark.django_db
def test_inbox_needs_a_signed_in_user(client, waiting):
    response = client.get(reverse("approvals:inbox"))
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


@pytest.mark.django_db
def test_inbox_lists_pending_first_with_a_countdown_and_no_inline_script(
    client, waiting, approver, system_actor
):
    settled = Approval.objects.get(
        run=start_refund(system_actor, input={"order_id": "ord_1006", "amount_cents": 30_000})
    )
    from approvals.services import approval_decide
    from runs.actors import Actor

    approval_decide(
        approval_id=settled.id,
        decision="reject",
        comment="no",
        actor=Actor.for_user(approver, "web"),
    )
    client.force_login(approver)

    page = client.get(reverse("approvals:inbox"))

    assert page.status_code == 200
    assert "Refund 500.00 EUR to order ord_1004 (customer ***)" in page.content.decode()
    html = page.content.decode()
    assert (
        html.index(_detail(waiting)) < html.index("Recently settled") < html.index(_detail(settled))
    )
    assert 'class="countdown"' in html and "data-seconds-left=" in html
    assert "js/countdown.js" in html
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "inline script"
    assert CUSTOMER_EMAIL not in html
    assert f'href="{reverse("approvals:inbox")}"' in html  # the nav link


@pytest.mark.django_db
def test_inbox_filters_by_agent_and_tool_and_htmx_gets_the_list_only(client, waiting, approver):
    client.force_login(approver)

    by_tool = client.get(reverse("approvals:inbox"), {"tool": "refund_payment"})
    other_tool = client.get(reverse("approvals:inbox"), {"tool": "lookup_order"})
    other_agent = client.get(reverse("approvals:inbox"), {"agent": "followup"})
    partial = client.get(
        reverse("approvals:inbox"), {"agent": "refund"}, headers={"HX-Request": "true"}
    )

    assert _detail(waiting) in by_tool.content.decode()
    assert _detail(waiting) not in other_tool.content.decode()
    assert _detail(waiting) not in other_agent.content.decode()
    assert _detail(waiting) in partial.content.decode()
    assert b"<html" not in partial.content


@pytest.mark.django_db
def test_inbox_queries_do_not_grow_with_the_rows(
    client, sandbox, system_actor, approver, django_assert_max_num_queries
):
    for order in ("ord_1004", "ord_1006", "ord_1003"):
        start_refund(system_actor, input={"order_id": order, "amount_cents": 20_000})
    client.force_login(approver)

    # at most four of them tell which rows the approver may decide (approvals.selectors.decidable)
    with django_assert_max_num_queries(16):
        page = client.get(reverse("approvals:inbox"))

    assert page.content.decode().count("approvals/") >= 3


@pytest.mark.django_db
def test_detail_shows_the_run_context_and_the_decision_form(client, waiting, approver):
    client.force_login(approver)

    page = client.get(_detail(waiting))

    assert page.status_code == 200
    html = page.content.decode()
    assert str(waiting.run_id)[:8] in html
    assert "lookup_order" in html  # the run's earlier step
    assert "approval.requested" in html  # its events
    assert "reconcilable" in html
    assert CUSTOMER_EMAIL not in html
    # what is asked, in one line, at the top
    assert "Refund 500.00 EUR to order ord_1004 (customer ***)" in html
    assert "csrfmiddlewaretoken" in html
    for action in ("approve", "reject", "edit", "comment"):
        assert f'name="action" value="{action}"' in html


@pytest.mark.django_db
def test_approving_on_the_page_is_a_post_with_csrf(waiting, approver):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(approver)
    browser.get(_detail(waiting))

    assert browser.get(_decide(waiting)).status_code == 405
    assert browser.post(_decide(waiting), {"action": "approve"}).status_code == 403  # no CSRF
    waiting.refresh_from_db()
    assert waiting.status == Approval.Status.PENDING

    response = browser.post(
        _decide(waiting),
        {
            "action": "approve",
            "comment": "fine",
            "csrfmiddlewaretoken": browser.cookies["csrftoken"].value,
        },
    )

    assert response.status_code == 302
    waiting.refresh_from_db()
    assert waiting.status == Approval.Status.APPROVED
    (decided,) = events(waiting.run_id, "approval.decided")
    assert (decided.actor, decided.channel) == ("user:alice", "web")
    page = browser.get(response["Location"])
    assert b"You approved this call." in page.content
    assert b'name="action"' not in page.content


@pytest.mark.django_db
def test_htmx_decision_swaps_the_panel(client, waiting, approver):
    client.force_login(approver)

    response = client.post(
        _decide(waiting),
        {"action": "reject", "comment": "duplicate"},
        headers={"HX-Request": "true"},
    )

    assert response.status_code == 200
    assert b'id="decision-panel"' in response.content and b"<html" not in response.content
    assert b"rejected" in response.content
    waiting.refresh_from_db()
    assert (waiting.status, waiting.reason) == (Approval.Status.REJECTED, "duplicate")


@pytest.mark.django_db
def test_rejecting_without_a_reason_is_a_form_error(client, waiting, approver):
    client.force_login(approver)

    response = client.post(_decide(waiting), {"action": "reject", "comment": ""})

    assert response.status_code == 400
    assert b"Give a reason" in response.content
    waiting.refresh_from_db()
    assert waiting.status == Approval.Status.PENDING


@pytest.mark.parametrize(
    ("posted", "message"),
    [
        ({}, b"This field is required."),
        ({"action": "approve!"}, b"Select a valid choice."),
        ({"action": "approve", "comment": "x" * 2001}, b"at most 2000 characters"),
    ],
)
@pytest.mark.django_db
def test_errors_no_action_form_shows_are_shown_above_the_forms(
    client, waiting, approver, posted, message
):
    """No action, an unknown one, or a comment on an approve (a request made by hand): the
    chosen action's form shows no such field, so its error is shown above the forms (found
    by tests/runs/test_forms_fuzzed.py: a 400 that showed nothing)."""
    client.force_login(approver)

    response = client.post(_decide(waiting), posted)

    assert response.status_code == 400
    assert b'role="alert"' in response.content and message in response.content
    waiting.refresh_from_db()
    assert waiting.status == Approval.Status.PENDING


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ('{"order_id": "ord_1004", "amount_cents": -5}', b"minimum of 1"),
        ('{"order_id": "ord_1004", "amount_cents": 5, "note": "x"}', b"Additional properties"),
        ('{"order_id": "ord_1004", "amount_cents": ', b"Not valid JSON"),
        ("[1, 2]", b"must be a JSON object"),
    ],
)
@pytest.mark.django_db
def test_edited_arguments_failing_the_schema_are_a_form_error(
    client, waiting, approver, arguments, message
):
    client.force_login(approver)
    call_before = ToolCall.objects.get(id=waiting.tool_call_id)

    response = client.post(_decide(waiting), {"action": "edit", "arguments": arguments})

    assert response.status_code == 400
    assert message in response.content
    assert b'<details class="decide" open>' in response.content  # the edit form, reopened
    waiting.refresh_from_db()
    assert waiting.status == Approval.Status.PENDING
    assert ApprovalDecision.objects.filter(approval=waiting).count() == 0
    call = ToolCall.objects.get(id=waiting.tool_call_id)
    assert (call.arguments, call.arguments_digest) == (
        call_before.arguments,
        call_before.arguments_digest,
    )


@pytest.mark.django_db
def test_editing_on_the_page_approves_the_edit(client, waiting, approver):
    client.force_login(approver)

    response = client.post(
        _decide(waiting),
        {
            "action": "edit",
            "arguments": '{"order_id": "ord_1004", "amount_cents": 12345, "reason": "", '
            '"customer_email": "***"}',
        },
    )

    assert response.status_code == 302
    call = ToolCall.objects.get(id=waiting.tool_call_id)
    assert call.arguments["amount_cents"] == 12345
    assert call.arguments["customer_email"] == CUSTOMER_EMAIL
    page = client.get(_detail(waiting)).content.decode()
    assert "12345" in page and "50000" in page  # the edit beside the original


@pytest.mark.django_db
def test_people_who_may_not_decide_see_no_form_and_their_posts_decide_nothing(
    client, waiting, operator, viewer
):
    client.force_login(viewer)
    assert client.get(_detail(waiting)).status_code == 403
    assert client.post(_decide(waiting), {"action": "approve"}).status_code == 403

    client.force_login(operator)  # may look, may not decide
    page = client.get(_detail(waiting))
    assert page.status_code == 200
    assert b'name="action"' not in page.content
    refused = client.post(_decide(waiting), {"action": "approve"})
    assert refused.status_code == 403

    waiting.refresh_from_db()
    assert waiting.status == Approval.Status.PENDING
    assert ApprovalDecision.objects.filter(approval=waiting).count() == 0


@pytest.mark.django_db
def test_a_second_decision_on_the_page_is_a_clear_conflict(
    client, waiting, approver, second_approver
):
    client.force_login(approver)
    client.post(_decide(waiting), {"action": "approve"})
    client.force_login(second_approver)

    response = client.post(_decide(waiting), {"action": "reject", "comment": "no"})

    assert response.status_code == 409
    assert b"already approved" in response.content
    waiting.refresh_from_db()
    assert waiting.status == Approval.Status.APPROVED


# --- readable calls, links to the run, why one cannot decide (issue 21 items 1, 2, 6) -------


def _arg_row(name: str, text: str) -> str:
    return f'<tr><th scope="row">{name}</th><td>{text}</td></tr>'


@pytest.mark.django_db
def test_inbox_and_page_show_arguments_as_a_table_with_money_and_link_to_the_run(
    client, waiting, approver
):
    client.force_login(approver)
    run = waiting.run
    run_link = f'<a class="run-link" href="/runs/{run.id}/" title="run {run.id}">refund · {str(run.id)[:8]}</a>'
    if run.goal:
        run_link = run_link.replace("refund · ", f"refund · {run.goal} · ")
    for url in (reverse("approvals:inbox"), _detail(waiting)):
        html = client.get(url).content.decode()
        assert _arg_row("amount_cents", "500.00 EUR") in html
        assert _arg_row("order_id", "ord_1004") in html
        assert _arg_row("customer_email", "***") in html  # masked stays masked
        assert CUSTOMER_EMAIL not in html
        assert "{&#x27;" not in html and "&#x27;amount_cents&#x27;:" not in html  # no dicts
        assert run_link in html
    # the run's context: the earlier lookup step as a summary and a table, not a dict
    html = client.get(_detail(waiting)).content.decode()
    steps = html[html.index('<ol class="steps">') : html.index("</ol>")]
    assert _arg_row("order_id", "ord_1004") in steps
    assert "{&#x27;tool&#x27;" not in steps


@pytest.mark.django_db
def test_the_run_page_shows_each_call_as_its_summary_and_a_table(client, waiting, operator):
    client.force_login(operator)
    html = client.get(reverse("runs:detail", args=[waiting.run_id])).content.decode()
    assert "Refund 500.00 EUR to order ord_1004 (customer ***)" in html
    assert _arg_row("amount_cents", "500.00 EUR") in html


@pytest.mark.django_db
def test_cannot_decide_says_which_rule_applies(client, waiting, approver, django_user_model):
    from django.contrib.auth.models import Group

    from approvals.services import approval_decide
    from runs.actors import Actor

    # the run's principal
    Approval.objects.filter(id=waiting.id).update(required_count=2)
    waiting.run.__class__.objects.filter(id=waiting.run_id).update(principal=approver)
    client.force_login(approver)
    html = client.get(_detail(waiting)).content.decode()
    assert "You are the run&#x27;s principal (alice)" in html
    assert "another member of approver must decide it" in html

    # someone outside the group
    outsider = django_user_model.objects.create_user(username="oscar", password="pw")
    outsider.groups.add(Group.objects.get(name="viewer"))
    outsider.groups.add(Group.objects.get(name="approver"))
    waiting.run.__class__.objects.filter(id=waiting.run_id).update(principal=None)
    Approval.objects.filter(id=waiting.id).update(approver_group="finance")
    client.force_login(outsider)
    html = client.get(_detail(waiting)).content.decode()
    assert "It is addressed to group finance, and you are not in it." in html

    # already decided (one of two approvals)
    Approval.objects.filter(id=waiting.id).update(approver_group="approver")
    approval_decide(
        approval_id=waiting.id, decision="approve", actor=Actor.for_user(outsider, "web")
    )
    html = client.get(_detail(waiting)).content.decode()
    assert "You already approved it; someone else in approver must decide too." in html
    assert "<strong>oscar</strong> approved via web" in html


@pytest.mark.django_db
def test_an_approval_past_its_expiry_says_so_and_offers_no_form(client, waiting, approver):
    from datetime import timedelta

    from django.utils import timezone

    Approval.objects.filter(id=waiting.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    client.force_login(approver)
    html = client.get(_detail(waiting)).content.decode()
    assert "It has expired" in html
    assert 'name="action" value="approve"' not in html
