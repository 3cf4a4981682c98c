"""Governance, the rest of issue 23: approver quotas per group in one rule ("two approvers,
one from finance"), withdrawing a data policy back to the code policy, simulation against the
policy in force today with its cap stated, which decisions a re-request voids, and dry-run
badges wherever an operator or approver meets a run."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth.models import Group
from django.core import mail
from django.core.management import call_command
from django.db import transaction
from django.urls import reverse
from rest_framework.test import APIClient

from approvals import policies, quorum
from approvals.gate import current_version
from approvals.models import Approval, ApprovalPolicyVersion
from approvals.policy_services import (
    PolicyConflict,
    SeparationOfDuties,
    policy_simulate,
    policy_withdraw,
)
from approvals.services import approval_decide
from runs.actors import Actor, PermissionDenied
from runs.models import AuditEntry, Run
from runs.services import run_create
from tests.approvals.test_policies import _refund, draft, publish
from tests.conftest import _user_in, drive
from tests.support import events, refund_posts

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

TWO_ONE_FROM_FINANCE = [
    {
        "when": "args.amount_cents > 5000",
        "decide": "require_approval",
        "approval": {"group": "approver", "required": 2, "from_groups": {"finance": 1}},
    }
]
TWO_ABOVE_50 = [
    {
        "when": "args.amount_cents > 5000",
        "decide": "require_approval",
        "approval": {"group": "approver", "required": 2},
    }
]


@pytest.fixture
def finance(db):
    return Group.objects.get_or_create(name="finance")[0]


@pytest.fixture
def ada(django_user_model):
    return _user_in(django_user_model, "ada", "admin")


@pytest.fixture
def bea(django_user_model):
    return _user_in(django_user_model, "bea", "admin")


@pytest.fixture
def fay(django_user_model, finance):
    """In finance, and holds the approver permission through the admin role — but not in
    the ``approver`` group: she decides only where a rule asks for finance."""
    return _user_in(django_user_model, "fay", "admin", "finance")


def _decide(approval, user, decision="approve", comment=""):
    return approval_decide(
        approval_id=approval.id,
        decision=decision,
        comment=comment,
        actor=Actor.for_user(user, "web"),
    )


# --- the quorum, pure -------------------------------------------------------------------------


def _who(key, *groups, superuser=False):
    return quorum.Approver(key=key, groups=frozenset(groups), superuser=superuser)


def test_each_approver_fills_one_groups_seat_and_the_quorum_names_what_is_missing():
    both = _who(1, "finance", "legal")
    minimums = {"finance": 1, "legal": 1}
    alone = quorum.assess([both], group="approver", required=2, minimums=minimums)
    assert not alone.met
    assert alone.missing_total == 1
    assert alone.describe() in ("1 of 2, needs 1 from legal", "1 of 2, needs 1 from finance")
    with_legal = quorum.assess(
        [both, _who(2, "legal")], group="approver", required=2, minimums=minimums
    )
    assert with_legal.met and with_legal.describe() == "2 of 2"
    # a superuser counts towards the total, not towards finance unless a member
    boss = _who(3, superuser=True)
    standing = quorum.assess(
        [boss, _who(4, "approver")], group="approver", required=2, minimums={"finance": 1}
    )
    assert (standing.approvals, standing.missing) == (2, {"finance": 1})


def test_an_approval_that_would_not_count_is_refused_with_the_reason():
    first = [_who(1, "approver")]
    assert "1 from finance" in quorum.refusal(
        first, _who(2, "approver"), group="approver", required=2, minimums={"finance": 1}
    )
    assert not quorum.refusal(
        first, _who(3, "finance"), group="approver", required=2, minimums={"finance": 1}
    )
    # with seats to spare, anyone of the pool counts
    assert not quorum.refusal(
        [], _who(2, "approver"), group="approver", required=2, minimums={"finance": 1}
    )


def test_from_groups_is_validated_on_save_with_clear_errors():
    def errors(spec):
        rule = {"when": "", "decide": "require_approval", "approval": spec}
        found = policies.validate(
            [rule], time_zone="UTC", tool_schema=None, groups={"approver", "finance"}
        )
        return " ".join(found.get("rule 1", []))

    assert errors({"required": 2, "from_groups": {"finance": 1}}) == ""
    assert "no group named 'legal'" in errors({"required": 2, "from_groups": {"legal": 1}})
    assert "whole number from 1 to 10" in errors({"required": 2, "from_groups": {"finance": 0}})
    assert "whole number from 1 to 10" in errors({"required": 2, "from_groups": {"finance": "1"}})
    assert "required must be at least the sum" in errors(
        {"required": 1, "from_groups": {"finance": 2}}
    )
    assert "must be an object" in errors({"required": 2, "from_groups": ["finance"]})
    requirement = policies.Requirement.from_rule({"required": 2, "from_groups": {"finance": 1}})
    assert requirement.describe() == "2 approvers from approver or finance, at least 1 from finance"


# --- quotas, enforced -------------------------------------------------------------------------


def test_two_approvers_one_from_finance_settles_only_with_finance(
    sandbox, system_actor, ada, bea, fay, approver, second_approver, client
):
    version, _ = publish(bea, draft(ada, rules=TWO_ONE_FROM_FINANCE, note="two, one finance"))
    run = _refund(system_actor, 6000)
    approval = Approval.objects.get(run=run)
    assert approval.group_minimums == {"finance": 1}
    assert approval.required_count == 2 and approval.policy_version_id == version.id
    (requested,) = events(run.id, "approval.requested")
    assert requested.payload["from_groups"] == {"finance": 1}

    _decide(approval, approver)
    decided = events(run.id, "approval.decided")[-1]
    assert decided.payload["settled"] is False
    assert decided.payload["needs"] == {"finance": 1}

    # the page says where it stands, and tells bob why he cannot be the second
    client.force_login(second_approver)
    page = client.get(reverse("approvals:detail", args=[approval.id])).content.decode()
    assert "1 of 2, needs 1 from finance" in page
    assert "would not count" in page
    with pytest.raises(PermissionDenied, match="1 from finance"), transaction.atomic():
        _decide(approval, second_approver)
    approval.refresh_from_db()
    assert approval.status == "pending" and approval.decisions.count() == 1

    # fay is not in the approver group, but finance may decide: she sees it and settles it
    client.force_login(fay)
    inbox = client.get(reverse("approvals:inbox")).content.decode()
    assert f'href="{reverse("approvals:detail", args=[approval.id])}"' in inbox
    assert "at least 1 from finance" in inbox
    _decide(approval, fay)
    approval.refresh_from_db()
    assert approval.status == "approved"
    assert drive(run.id).status == Run.Status.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1


def test_the_api_shows_the_groups_minimums(sandbox, system_actor, ada, bea, fay, approver, finance):
    publish(bea, draft(ada, rules=TWO_ONE_FROM_FINANCE, note="two, one finance"))
    run = _refund(system_actor, 6000)
    approval = Approval.objects.get(run=run)
    api = APIClient()
    api.force_authenticate(approver)
    body = api.get(f"/api/v1/approvals/{approval.id}/").json()
    assert body["group_minimums"] == {"finance": 1}
    assert body["required_count"] == 2
    assert body["policy_version"] == approval.policy_version_id
    assert body["dry_run"] is False


# the engine's checkpoint refuses without a savepoint (it is never nested in production)
@pytest.mark.django_db(transaction=True)
def test_the_dispatch_re_requests_an_approval_without_its_finance_minimum(
    sandbox, system_actor, ada, bea, fay, approver, second_approver
):
    publish(bea, draft(ada, rules=TWO_ABOVE_50))
    run = _refund(system_actor, 6000)
    old = Approval.objects.get(run=run)
    _decide(old, approver)
    _decide(old, second_approver)
    old.refresh_from_db()
    assert old.status == "approved"
    # approved by two approvers, not yet dispatched; now one must be from finance
    v2, done = publish(bea, draft(ada, rules=TWO_ONE_FROM_FINANCE, note="one from finance"))
    assert done.rerequested == []
    run = drive(run.id)
    assert run.status == Run.Status.WAITING_APPROVAL
    assert refund_posts(sandbox) == []
    old.refresh_from_db()
    assert (old.status, old.reason, old.consumed_at) == ("cancelled", "policy_changed", None)
    cancelled = events(run.id, "approval.cancelled")[-1]
    assert [v["by"] for v in cancelled.payload["voided"]] == ["alice", "bob"]
    new = Approval.objects.get(run=run, status="pending")
    requested = events(run.id, "approval.requested")[-1]
    assert requested.payload["replaces"] == old.id
    assert [v["by"] for v in requested.payload["voided"]] == ["alice", "bob"]
    # nothing carried over: everyone decides again
    assert new.decisions.count() == 0 and new.group_minimums == {"finance": 1}
    _decide(new, approver)
    _decide(new, fay)
    assert drive(run.id).status == Run.Status.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1


# --- re-request: which decisions were voided -------------------------------------------------


def test_a_tightened_policy_re_requests_and_says_whose_decisions_no_longer_count(
    sandbox, system_actor, ada, bea, fay, approver, client
):
    publish(bea, draft(ada, rules=TWO_ABOVE_50))
    run = _refund(system_actor, 6000)
    old = Approval.objects.get(run=run)
    _decide(old, approver)  # 1 of 2
    _, done = publish(bea, draft(ada, rules=TWO_ONE_FROM_FINANCE, note="one from finance"))
    old.refresh_from_db()
    assert old.status == "cancelled" and old.reason.startswith("policy_changed: version 2")
    new = Approval.objects.get(run=run, status="pending")
    assert done.rerequested == [new.id]
    cancelled = events(run.id, "approval.cancelled")[-1]
    (voided,) = cancelled.payload["voided"]
    assert (voided["by"], voided["decision"]) == ("alice", "approve")
    requested = events(run.id, "approval.requested")[-1]
    assert requested.payload["replaces"] == old.id
    assert requested.payload["why"] == old.reason
    assert requested.payload["voided"] == cancelled.payload["voided"]
    assert new.decisions.count() == 0
    # the run's timeline says it in words
    from runs.timeline import describe

    assert describe("approval.cancelled", cancelled.payload).endswith(
        "cancelled (policy_changed); voided (decide again): alice approved"
    )
    line = describe("approval.requested", requested.payload)
    assert "from approver (at least 1 from finance)" in line
    assert f"asked again, replacing #{old.id} (policy_changed: version 2" in line
    assert line.endswith("voided (decide again): alice approved")

    client.force_login(fay)
    timeline = client.get(reverse("runs:detail", args=[run.id])).content.decode()
    assert "voided (decide again): alice approved" in timeline
    page = client.get(reverse("approvals:detail", args=[new.id])).content.decode()
    assert "Asked again" in page
    assert f"approval {old.id}" in page
    assert "not carried over" in page and "alice approved" in page
    old_page = client.get(reverse("approvals:detail", args=[old.id])).content.decode()
    assert f'asked again as <a href="{reverse("approvals:detail", args=[new.id])}">' in old_page


# --- withdrawal -------------------------------------------------------------------------------


def test_a_withdrawal_is_a_version_published_by_a_second_admin_and_brings_back_the_code_policy(
    sandbox, system_actor, ada, bea
):
    v1, _ = publish(bea, draft(ada))
    withdrawal = policy_withdraw(
        actor=Actor.for_user(ada, "web"), policy_id=v1.policy_id, note="pilot over"
    )
    assert (withdrawal.withdraws, withdrawal.status, withdrawal.number) == (True, "draft", 2)
    # until it is published the policy stays in force
    assert current_version("refund_payment").id == v1.id
    with pytest.raises(SeparationOfDuties), transaction.atomic():
        publish(ada, withdrawal)
    publish(bea, withdrawal)
    v1.refresh_from_db()
    assert v1.status == "superseded"
    assert current_version("refund_payment") is None
    # 60.00 is under the code policy's 100.00: no approval any more
    run = _refund(system_actor, 6000)
    assert run.status == Run.Status.SUCCEEDED
    assert not Approval.objects.filter(run=run).exists()
    actions = list(AuditEntry.objects.order_by("id").values_list("action", "actor"))
    assert actions[-2:] == [
        ("policy.withdrawal_drafted", "user:ada"),
        ("policy.withdrawn", "user:bea"),
    ]
    # nothing left to withdraw
    with pytest.raises(PolicyConflict, match="nothing to withdraw"), transaction.atomic():
        policy_withdraw(actor=Actor.for_user(ada, "web"), policy_id=v1.policy_id, note="again")
    # a new version puts it back
    publish(bea, draft(ada, note="back again"))
    assert current_version("refund_payment").number == 3


def test_withdrawing_re_checks_waiting_approvals_against_the_code_policy(
    sandbox, system_actor, ada, bea, finance
):
    one_from_finance = [
        {
            "when": "args.amount_cents > 5000",
            "decide": "require_approval",
            "approval": {"group": "finance", "required": 1},
        }
    ]
    v1, _ = publish(bea, draft(ada, rules=one_from_finance, note="finance decides"))
    run = _refund(system_actor, 50_000)
    old = Approval.objects.get(run=run)
    assert old.approver_group == "finance"
    withdrawal = policy_withdraw(
        actor=Actor.for_user(ada, "web"), policy_id=v1.policy_id, note="pilot over"
    )
    _, done = publish(bea, withdrawal)
    old.refresh_from_db()
    assert old.status == "cancelled"
    new = Approval.objects.get(run=run, status="pending")
    assert done.rerequested == [new.id]
    # asked again as the code policy asks: one approver from approver, no data version
    assert (new.approver_group, new.required_count, new.policy_version_id) == ("approver", 1, None)


def test_withdrawing_from_the_console_and_publishing_by_another_admin(
    client, ada, bea, sandbox, system_actor
):
    v1, _ = publish(bea, draft(ada))
    client.force_login(ada)
    page = client.get(reverse("approvals:policy", args=[v1.policy_id])).content.decode()
    assert "Withdraw this policy" in page
    # a note is required: nothing written without one
    response = client.post(reverse("approvals:policy_withdraw", args=[v1.policy_id]), {})
    assert response.status_code == 302
    assert ApprovalPolicyVersion.objects.count() == 1
    response = client.post(
        reverse("approvals:policy_withdraw", args=[v1.policy_id]),
        {"note": "pilot over", "based_on": str(v1.id)},
    )
    withdrawal = ApprovalPolicyVersion.objects.get(withdraws=True)
    assert response["Location"] == reverse("approvals:policy_version", args=[withdrawal.id])
    page = client.get(response["Location"]).content.decode()
    assert "withdrawal" in page and "You drafted this version" in page
    client.force_login(bea)
    response = client.post(reverse("approvals:policy_publish", args=[withdrawal.id]))
    assert response.status_code == 302
    page = client.get(reverse("approvals:policy", args=[v1.policy_id])).content.decode()
    assert "Withdrawn by version 2" in page
    listing = client.get(reverse("approvals:policies")).content.decode()
    assert "badge-withdrawn" in listing
    # drafting again starts from the last rules, not from the empty withdrawal
    form = client.get(reverse("approvals:policy_draft") + f"?policy={v1.policy_id}")
    assert "args.amount_cents &gt; 5000" in form.content.decode()


def test_withdrawing_over_the_api(ada, bea):
    v1, _ = publish(bea, draft(ada))
    api = APIClient()
    api.force_authenticate(ada)
    url = f"/api/v1/policies/{v1.policy_id}/withdrawal/"
    missing = api.post(url, {}, format="json")
    assert missing.status_code == 400 and missing.json()["code"] == "validation_error"
    created = api.post(url, {"note": "pilot over"}, format="json")
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["withdraws"] is True and body["status"] == "draft" and body["rules"] == []
    assert (
        api.post("/api/v1/policies/999999/withdrawal/", {"note": "x"}, format="json").json()["code"]
        == "not_found"
    )
    published = APIClient()
    published.force_authenticate(bea)
    answer = published.post(f"/api/v1/policy-versions/{body['id']}/publication/")
    assert answer.status_code == 200
    again = api.post(url, {"note": "again"}, format="json")
    assert again.status_code == 409 and again.json()["code"] == "invalid_state"


# --- simulation against today's policy --------------------------------------------------------


def _history(system_actor, amounts=(500, 6000, 20_000)):
    for amount in amounts:
        _refund(system_actor, amount)


def test_a_scoped_draft_is_compared_with_the_broader_data_policy_in_force(
    sandbox, system_actor, ada, bea
):
    publish(bea, draft(ada))  # the tool's own: two above 50.00
    _history(system_actor)
    # the same rules for the refund agent only: nothing changes for these calls (the code
    # policy would have said otherwise for the 60.00 and 200.00 refunds)
    scoped = draft(ada, agent_name="refund", note="same, for the refund agent")
    simulation = policy_simulate(actor=Actor.system("cli"), version_id=scoped.id, days=1)
    assert simulation.counts["unchanged"] == 3
    assert not simulation.changed
    assert simulation.compared_with == "version 1 of the policy for every agent"
    assert {c.before_policy for c in simulation.calls} == {
        "version 1 of the policy for every agent"
    }


def test_a_withdrawal_is_simulated_against_the_code_policy(sandbox, system_actor, ada, bea):
    v1, _ = publish(bea, draft(ada))
    _history(system_actor)
    withdrawal = policy_withdraw(
        actor=Actor.for_user(ada, "web"), policy_id=v1.policy_id, note="pilot over"
    )
    simulation = policy_simulate(actor=Actor.system("cli"), version_id=withdrawal.id, days=1)
    assert simulation.compared_with == "version 1"
    # 60.00: two approvers today, none under the code policy; 200.00: two today, one then
    assert simulation.counts["no_longer_requires_approval"] == 1
    assert simulation.counts["requirement_changed"] == 1
    assert simulation.counts["unchanged"] == 1
    changed = {c.after for c in simulation.changed}
    assert changed == {"allow", "require approval (1 approver from approver)"}


def test_the_cap_is_stated_on_the_page_and_in_the_command(
    sandbox, system_actor, ada, client, monkeypatch
):
    from approvals import policy_services

    _history(system_actor)
    monkeypatch.setattr(policy_services, "SIMULATE_MAX_CALLS", 2)
    version = draft(ada)
    simulation = policy_simulate(actor=Actor.system("cli"), version_id=version.id, days=1)
    assert simulation.truncated and len(simulation.calls) == 2
    assert simulation.as_dict()["limit"] == 2
    assert "only the newest 2 calls were replayed" in simulation.truncation_note
    client.force_login(ada)
    page = client.post(
        reverse("approvals:policy_simulate", args=[version.id]), {"days": "1"}
    ).content.decode()
    assert "Capped: only the newest 2 calls were replayed" in page
    out, err = StringIO(), StringIO()
    call_command("policy_simulate", str(version.id), "--days", "1", stdout=out, stderr=err)
    assert "CAPPED: only the newest 2 calls were replayed" in out.getvalue()
    out, err = StringIO(), StringIO()
    call_command("policy_simulate", str(version.id), "--json", stdout=out, stderr=err)
    assert json.loads(out.getvalue())["truncated"] is True
    assert "CAPPED" in err.getvalue()
    # the version page keeps it beside the Publish button
    page = client.get(reverse("approvals:policy_version", args=[version.id])).content.decode()
    assert "Capped:" in page


# --- the console's draft form -----------------------------------------------------------------


def _draft_form(**rule):
    data = {
        "tool": "refund_payment",
        "agent_name": "",
        "principal_group": "",
        "time_zone": "UTC",
        "note": "two, one from finance",
        "rules-TOTAL_FORMS": "1",
        "rules-INITIAL_FORMS": "0",
        "rules-MIN_NUM_FORMS": "0",
        "rules-MAX_NUM_FORMS": "50",
        "rules-0-when": "args.amount_cents > 5000",
        "rules-0-decide": "require_approval",
        "rules-0-group": "approver",
        "rules-0-required": "2",
        "rules-0-ttl_hours": "24",
        "rules-0-on_expiry": "reject",
    }
    data.update({f"rules-0-{key}": value for key, value in rule.items()})
    return data


def test_the_draft_form_takes_per_group_minimums(client, ada, finance):
    client.force_login(ada)
    url = reverse("approvals:policy_draft")
    bad = client.post(url, _draft_form(from_groups="finance")).content.decode()
    assert "Write each group as name=number" in bad
    too_many = client.post(url, _draft_form(from_groups="finance=3")).content.decode()
    assert "required must be at least the sum" in too_many
    assert not ApprovalPolicyVersion.objects.exists()
    response = client.post(url, _draft_form(from_groups="finance=1"))
    assert response.status_code == 302
    version = ApprovalPolicyVersion.objects.get()
    assert version.rules[0]["approval"]["from_groups"] == {"finance": 1}
    page = client.get(response["Location"]).content.decode()
    assert "2 approvers from approver or finance, at least 1 from finance" in page
    # drafting a change starts from it, minimums included
    form = client.get(url + f"?policy={version.policy_id}&from={version.id}").content.decode()
    assert 'value="finance=1"' in form


# --- dry-run badges ---------------------------------------------------------------------------


def test_a_dry_runs_approval_is_marked_in_the_inbox_bulk_api_and_email(
    django_capture_on_commit_callbacks, sandbox, system_actor, alice
):
    from django.test import Client

    mail.outbox = []
    with django_capture_on_commit_callbacks(execute=True):
        run = run_create(
            agent_name="refund",
            input={"order_id": "ord_1004", "amount_cents": 50_000},
            actor=system_actor,
            dry_run=True,
        )
        run = drive(run.id)
    approval = Approval.objects.get(run=run)
    (message,) = [m for m in mail.outbox if "alice@example.com" in m.to]
    assert message.subject.startswith("[dry run] Approval needed")
    assert "Dry run:" in message.body
    client = Client()
    client.force_login(alice)
    inbox = client.get(reverse("approvals:inbox")).content.decode()
    assert "badge-dry-run" in inbox
    review = client.post(
        reverse("approvals:bulk"), {"decision": "approve", "approval": [approval.id]}
    ).content.decode()
    assert "badge-dry-run" in review
    api = APIClient()
    api.force_authenticate(alice)
    assert api.get(f"/api/v1/approvals/{approval.id}/").json()["dry_run"] is True
    # "Needs you" on the dashboard
    dashboard = client.get(reverse("runs:dashboard")).content.decode()
    assert "badge-dry-run" in dashboard
