"""Deciding from the approvals inbox (issue 21 item 4): a row's Approve… / Reject…, and
many at once, each after a confirmation page that shows every call as its summary and
arguments; each approval decided on its own through ``approval_decide``."""

from __future__ import annotations

import pytest
from django.urls import reverse

from approvals.models import Approval
from runs.models import Run, RunEvent
from tests.approvals.conftest import CUSTOMER_EMAIL, start_refund

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

BULK = "/approvals/bulk/"


@pytest.fixture
def two(sandbox, system_actor):
    first = start_refund(system_actor)
    second = start_refund(system_actor, input={"order_id": "ord_1006", "amount_cents": 30_000})
    return [Approval.objects.get(run=first), Approval.objects.get(run=second)]


def test_the_inbox_offers_decide_buttons_only_on_rows_i_may_decide(client, two, approver):
    mine, own = two
    Run.objects.filter(id=own.run_id).update(principal=approver)  # nobody approves their own
    client.force_login(approver)
    html = client.get(reverse("approvals:inbox")).content.decode()
    assert f'name="approval" value="{mine.id}" form="bulk-approvals"' in html
    assert f'name="approval" value="{own.id}"' not in html
    assert "not yours to decide" in html
    assert 'aria-label="Approve Refund 500.00 EUR to order ord_1004 (customer ***)…"' in html


def test_the_first_post_shows_each_call_and_decides_nothing(client, two, approver):
    mine, own = two
    Run.objects.filter(id=own.run_id).update(principal=approver)
    client.force_login(approver)

    page = client.post(BULK, {"decision": "approve", "approval": [mine.id, own.id]})

    html = page.content.decode()
    assert page.status_code == 200
    assert "Approve 1 call?" in html
    assert "Refund 500.00 EUR to order ord_1004 (customer ***)" in html
    assert '<tr><th scope="row">amount_cents</th><td>500.00 EUR</td></tr>' in html
    assert CUSTOMER_EMAIL not in html
    assert "Left out: You are the run&#x27;s principal (alice)" in html
    assert f'<input type="hidden" name="approval" value="{mine.id}">' in html
    assert f'<input type="hidden" name="approval" value="{own.id}">' not in html
    assert set(Approval.objects.values_list("status", flat=True)) == {"pending"}


def test_confirming_decides_each_one_and_says_what_happened_to_each(
    client, two, approver, second_approver
):
    first, second = two
    from approvals.services import approval_decide
    from runs.actors import Actor

    # someone else settles the second one meanwhile: refused, and the first still approved
    approval_decide(
        approval_id=second.id,
        decision="reject",
        comment="no",
        actor=Actor.for_user(second_approver, "web"),
    )
    client.force_login(approver)

    page = client.post(
        BULK, {"decision": "approve", "approval": [first.id, second.id], "confirm": "on"}
    )

    html = page.content.decode()
    assert page.status_code == 200
    assert "Done: approved." in html
    assert "Refused:" in html
    assert page["HX-Trigger"] == "runs-changed"
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.status, second.status) == ("approved", "rejected")
    decided = RunEvent.objects.get(run_id=first.run_id, type="approval.decided")
    assert (decided.actor, decided.channel) == ("user:alice", "web")


def test_rejecting_needs_a_reason_and_every_agent_receives_it(client, two, approver):
    client.force_login(approver)
    ids = [a.id for a in two]
    refused = client.post(BULK, {"decision": "reject", "approval": ids, "confirm": "on"})
    assert refused.status_code == 400
    assert set(Approval.objects.values_list("status", flat=True)) == {"pending"}

    client.post(BULK, {"decision": "reject", "approval": ids, "confirm": "on", "comment": "fraud"})
    assert set(Approval.objects.values_list("status", flat=True)) == {"rejected"}


def test_a_viewer_decides_nothing_and_get_is_refused(client, two, viewer):
    client.force_login(viewer)
    assert client.get(BULK).status_code in (403, 405)
    client.post(BULK, {"decision": "approve", "approval": [two[0].id], "confirm": "on"})
    assert set(Approval.objects.values_list("status", flat=True)) == {"pending"}
