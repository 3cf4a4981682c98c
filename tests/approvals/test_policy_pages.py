"""The console's approval policy pages (issue 23, items 3 and 4): list, draft with clear
errors, diff, simulate (page and ``policy_simulate``), publish by a second admin; auditors
read, only admins change."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.urls import reverse

from approvals.models import Approval, ApprovalPolicyVersion
from approvals.policy_services import policy_simulate
from runs.actors import Actor
from runs.models import AuditEntry, ToolCall
from runs.services import run_create
from tests.approvals.test_policies import draft, publish
from tests.conftest import _user_in, drive

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def ada(django_user_model):
    return _user_in(django_user_model, "ada", "admin")


@pytest.fixture
def bea(django_user_model):
    return _user_in(django_user_model, "bea", "admin")


@pytest.fixture
def auditor(django_user_model):
    return _user_in(django_user_model, "audrey", "auditor")


def _as(client, user):
    client.force_login(user)
    return client


def _history(system_actor, amounts=(500, 6000, 20_000)):
    """Refunds decided under the code policy (above 100.00 needs one approver)."""
    runs = []
    for amount in amounts:
        run = run_create(
            agent_name="refund",
            input={"order_id": "ord_1004", "amount_cents": amount},
            actor=system_actor,
        )
        runs.append(drive(run.id))
    return runs


def _draft_post(rules, note="above 50.00 needs two", **extra):
    data = {
        "tool": "refund_payment",
        "agent_name": "",
        "principal_group": "",
        "time_zone": "UTC",
        "note": note,
        "rules-TOTAL_FORMS": str(len(rules)),
        "rules-INITIAL_FORMS": "0",
        "rules-MIN_NUM_FORMS": "0",
        "rules-MAX_NUM_FORMS": "50",
    }
    for index, rule in enumerate(rules):
        for key, value in rule.items():
            data[f"rules-{index}-{key}"] = value
    data.update(extra)
    return data


TWO_ABOVE_50_FORM = {
    "when": "args.amount_cents > 5000",
    "decide": "require_approval",
    "group": "approver",
    "required": "2",
    "ttl_hours": "24",
    "on_expiry": "reject",
}


def test_the_list_shows_each_tool_with_its_code_policy_and_admins_may_write_one(client, ada):
    response = _as(client, ada).get(reverse("approvals:policies"))
    body = response.content.decode()
    assert response.status_code == 200
    assert "refund_payment" in body and "refunds above 100.00" in body
    assert "Write a policy" in body


def test_auditors_read_policies_but_cannot_draft_or_publish(client, ada, bea, auditor):
    version = draft(ada)
    client = _as(client, auditor)
    assert client.get(reverse("approvals:policies")).status_code == 200
    assert "Write a policy" not in client.get(reverse("approvals:policies")).content.decode()
    assert client.get(reverse("approvals:policy_version", args=[version.id])).status_code == 200
    assert client.get(reverse("approvals:policy_draft") + "?tool=refund_payment").status_code == 403
    response = client.post(reverse("approvals:policy_publish", args=[version.id]))
    assert response.status_code == 302
    version.refresh_from_db()
    assert version.status == "draft"


def test_a_viewer_cannot_read_policies(client, viewer):
    assert _as(client, viewer).get(reverse("approvals:policies")).status_code == 403


def test_drafting_from_the_console_then_publishing_by_another_admin(
    client, ada, bea, sandbox, system_actor
):
    client = _as(client, ada)
    form = client.get(reverse("approvals:policy_draft") + "?tool=refund_payment")
    assert form.status_code == 200
    response = client.post(reverse("approvals:policy_draft"), _draft_post([TWO_ABOVE_50_FORM]))
    assert response.status_code == 302, response.content.decode()[:2000]
    version = ApprovalPolicyVersion.objects.get()
    assert version.rules == [
        {
            "when": "args.amount_cents > 5000",
            "decide": "require_approval",
            "approval": {
                "group": "approver",
                "required": 2,
                "ttl_seconds": 86400,
                "on_expiry": "reject",
            },
        }
    ]
    page = client.get(response["Location"]).content.decode()
    assert "You drafted this version" in page
    # the drafter cannot publish, even by posting
    client.post(reverse("approvals:policy_publish", args=[version.id]))
    version.refresh_from_db()
    assert version.status == "draft"
    other = _as(client, bea)
    response = other.post(reverse("approvals:policy_publish", args=[version.id]))
    assert response.status_code == 302
    version.refresh_from_db()
    assert (version.status, version.published_by) == ("published", bea)
    assert "is now the policy" in other.get(response["Location"]).content.decode()


def test_an_invalid_rule_is_shown_on_its_row_and_nothing_is_saved(client, ada):
    bad = {**TWO_ABOVE_50_FORM, "when": "args.amount > 50.00"}
    response = _as(client, ada).post(reverse("approvals:policy_draft"), _draft_post([bad]))
    assert response.status_code == 200
    assert "The draft was not saved" in response.content.decode()
    body = response.content.decode()
    assert "args has no field &#x27;amount&#x27;" in body
    assert not ApprovalPolicyVersion.objects.exists()


def test_add_a_rule_keeps_what_was_typed(client, ada):
    response = _as(client, ada).post(
        reverse("approvals:policy_draft"), _draft_post([TWO_ABOVE_50_FORM], note="", add_rule="1")
    )
    body = response.content.decode()
    assert response.status_code == 200
    assert "Rule 2" in body and "args.amount_cents &gt; 5000" in body
    assert "errorlist" not in body
    assert not ApprovalPolicyVersion.objects.exists()


def test_the_version_page_diffs_against_the_version_it_was_drafted_from(client, ada, bea):
    first = draft(ada, rules=[], note="allow all")
    publish(bea, first)
    second = draft(ada)
    body = _as(client, bea).get(reverse("approvals:policy_version", args=[second.id])).content
    body = body.decode()
    assert "Changes from v1" in body
    assert 'class="diff-add"' in body and "args.amount_cents &gt; 5000" in body


def test_simulation_lists_the_calls_that_would_change(client, ada, sandbox, system_actor):
    _history(system_actor)
    version = draft(ada)
    response = _as(client, ada).post(
        reverse("approvals:policy_simulate", args=[version.id]),
        {"days": "7"},
        HTTP_HX_REQUEST="true",
    )
    body = response.content.decode()
    assert response.status_code == 200
    # 60.00 newly needs approval; 200.00 needed one approver and would need two; 5.00 as before
    assert 'data-change="newly_requires_approval"' in body
    assert 'data-change="requirement_changed"' in body
    simulation = policy_simulate(actor=Actor.system("cli"), version_id=version.id, days=7)
    assert simulation.counts["newly_requires_approval"] == 1
    assert simulation.counts["requirement_changed"] == 1
    assert simulation.counts["unchanged"] == 1
    version.refresh_from_db()
    assert version.simulated["counts"]["newly_requires_approval"] == 1


def test_simulate_refuses_a_bad_number_of_days(client, ada):
    version = draft(ada)
    response = _as(client, ada).post(
        reverse("approvals:policy_simulate", args=[version.id]), {"days": "9999"}
    )
    assert response.status_code == 400
    assert "days must be" in response.content.decode()


def test_the_command_simulates_a_version_and_rules_from_a_file(
    ada, sandbox, system_actor, tmp_path
):
    _history(system_actor)
    version = draft(ada)
    out = StringIO()
    call_command("policy_simulate", str(version.id), "--days", "3", stdout=out)
    text = out.getvalue()
    assert "compared with the code policy" in text
    assert "1  would newly need approval" in text
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"decide": "deny", "reason": "frozen"}]))
    out = StringIO()
    call_command(
        "policy_simulate", "--tool", "refund_payment", "--rules", str(rules), "--json", stdout=out
    )
    data = json.loads(out.getvalue())
    assert data["counts"]["newly_denied"] == 3
    assert all(c["after"] == "deny (frozen)" for c in data["changed"])


def test_calls_decided_before_facts_were_recorded_are_simulated_as_reconstructed(
    ada, sandbox, system_actor
):
    _history(system_actor, amounts=(6000,))
    ToolCall.objects.update(policy_input={})
    simulation = policy_simulate(actor=Actor.system("cli"), version_id=draft(ada).id, days=1)
    refund = next(c for c in simulation.calls if c.change != "unchanged")
    assert refund.reconstructed


def test_publishing_from_the_console_re_requests_a_pending_approval_and_is_audited(
    client, ada, bea, sandbox, system_actor
):
    (run,) = _history(system_actor, amounts=(20_000,))
    old = Approval.objects.get(run=run)
    version = draft(ada)
    response = _as(client, bea).post(reverse("approvals:policy_publish", args=[version.id]))
    page = client.get(response["Location"]).content.decode()
    assert "1 pending approval(s) asked again" in page
    old.refresh_from_db()
    assert old.status == "cancelled"
    assert Approval.objects.get(run=run, status="pending").required_count == 2
    entry = AuditEntry.objects.filter(action="policy.published").get()
    assert entry.actor == "user:bea" and entry.channel == "web"
