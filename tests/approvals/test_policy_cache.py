"""Deciding a call reads no policy table on the hot path (issue 23 on top of issue 19's one
statement per read step): which tools have a published data policy, and a principal's
groups, are what this process read within ``POLICY_REFRESH_SECONDS``. A publish in this
process applies at once; in another, within the interval; an approval is checked against
the version in force at its consumption, never a remembered one."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from approvals import gate as approvals_gate
from approvals.models import ApprovalPolicyVersion
from runs import gate as runs_gate
from runs.actors import Actor
from runs.gate import assess, policy_facts
from runs.registry import registry
from runs.services import run_create
from tests.approvals.test_policies import draft, publish
from tests.conftest import _user_in

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def remembered(settings, monkeypatch):
    """The production setting (the suite reads afresh each time), and a clock to move."""
    settings.AGENTOPS = {**settings.AGENTOPS, "POLICY_REFRESH_SECONDS": 1.0}
    clock = [1000.0]
    monkeypatch.setattr(approvals_gate.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(runs_gate.time, "monotonic", lambda: clock[0])
    approvals_gate.published_tools.clear()
    runs_gate._principals.clear()
    yield clock
    approvals_gate.published_tools.clear()
    runs_gate._principals.clear()


@pytest.fixture
def refund_run(django_user_model, sandbox):
    owner = _user_in(django_user_model, "olga", "operator")
    return run_create(
        agent_name="refund",
        input={"order_id": "ord_1004", "amount_cents": 100},
        actor=Actor.for_user(owner, "api"),
    )


def _decide(run, amount):
    tool = registry.tool("refund_payment")
    facts = policy_facts(run)
    return assess(
        run=run, tool=tool, arguments={"order_id": "o", "amount_cents": amount}, facts=facts
    ), facts


def test_a_tool_no_data_policy_governs_is_decided_with_no_query(remembered, refund_run):
    _decide(refund_run, 100)  # the first decision reads the index and the principal once
    with CaptureQueriesContext(connection) as queries:
        verdict, facts = _decide(refund_run, 100)
    assert queries.captured_queries == []
    assert not verdict.denied and facts["principal"] == "olga" and "operator" in facts["groups"]


def test_a_version_published_here_applies_to_the_next_decision(
    remembered, refund_run, django_user_model, django_capture_on_commit_callbacks
):
    before, _ = _decide(refund_run, 6000)
    ada = _user_in(django_user_model, "ada", "admin")
    bea = _user_in(django_user_model, "bea", "admin")
    with django_capture_on_commit_callbacks(execute=True):
        version, _ = publish(bea, draft(ada))
    verdict, _ = _decide(refund_run, 6000)  # the clock has not moved
    assert verdict.needs_approval and verdict.policy_version == version.id
    assert verdict.requirement.required == 2 and before.policy_version is None


def test_a_version_published_elsewhere_applies_once_the_interval_has_passed(
    remembered, refund_run, django_user_model
):
    assert _decide(refund_run, 6000)[0].policy_version is None  # read: no data policy
    ada = _user_in(django_user_model, "ada", "admin")
    bea = _user_in(django_user_model, "bea", "admin")
    # published as another process would: this process's commit hook never runs here
    version, _ = publish(bea, draft(ada))
    assert _decide(refund_run, 6000)[0].policy_version is None  # what it read still holds...
    remembered[0] += 1.0
    verdict, _ = _decide(refund_run, 6000)  # ...until the interval has passed
    assert verdict.needs_approval and verdict.policy_version == version.id
    # a tool that has a data policy has its current version read afresh at each decision:
    # a withdrawal elsewhere applies at once
    ApprovalPolicyVersion.objects.filter(id=version.id).update(status="superseded")
    assert _decide(refund_run, 6000)[0].policy_version is None


def test_a_principals_new_group_is_read_again_after_the_interval(
    remembered, refund_run, django_user_model
):
    from django.contrib.auth.models import Group

    assert "finance" not in policy_facts(refund_run)["groups"]
    finance, _ = Group.objects.get_or_create(name="finance")
    refund_run.principal.groups.add(finance)
    assert "finance" not in policy_facts(refund_run)["groups"]
    remembered[0] += 1.0
    assert "finance" in policy_facts(refund_run)["groups"]


# the engine's checkpoint refuses without a savepoint: a test transaction would be left broken
@pytest.mark.django_db(transaction=True)
def test_a_call_that_needs_approval_asks_for_it_with_nothing_read_on_the_way(
    remembered, sandbox, system_actor
):
    """With the production setting, nothing is read between the decision and the request
    of its approval, so the call is not written yet when the gate asks whether it replaces
    an earlier approval (chaos through PgBouncer found the request failing on that)."""
    from approvals.models import Approval
    from runs.models import Run
    from tests.conftest import drive

    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1004", "amount_cents": 50_000},
        actor=system_actor,
    )
    run = drive(run.id)
    assert run.status == Run.Status.WAITING_APPROVAL
    assert Approval.objects.filter(run=run, status="pending").count() == 1
