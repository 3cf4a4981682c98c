"""Deciding a call reads no policy table on the hot path (issue 23 on top of issue 19's one
statement per read step): which tools have a published data policy, and a principal's name
and groups, are what this process read since they last changed. Database triggers move their
generations in the commit that changes them, however it is changed, and every claim carries
the generations (runs.record.configcache): a change committed anywhere is seen from the next
claim on, with no interval. A publish in this process applies at its commit; an approval is
checked against the version in force at its consumption, never a remembered one."""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from approvals import gate as approvals_gate
from approvals.models import Approval, ApprovalPolicyVersion
from runs.actors import Actor
from runs.engine.claim import claim
from runs.gate import assess, policy_facts
from runs.models import Run
from runs.record import configcache
from runs.registry import registry
from runs.services import run_create
from tests.approvals.test_policies import draft, publish
from tests.conftest import _user_in, drive

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def olga(django_user_model):
    return _user_in(django_user_model, "olga", "operator")


def _refund(owner, amount_cents=100):
    return run_create(
        agent_name="refund",
        input={"order_id": "ord_1004", "amount_cents": amount_cents},
        actor=Actor.for_user(owner, "api"),
    )


@pytest.fixture
def refund_run(olga, sandbox):
    return _refund(olga)


def _decide(run, amount):
    tool = registry.tool("refund_payment")
    facts = policy_facts(run)
    return assess(
        run=run, tool=tool, arguments={"order_id": "o", "amount_cents": amount}, facts=facts
    ), facts


def _next_claim(owner):
    """Any worker's next claim (of another run of the same principal)."""
    lease = claim(_refund(owner).id, worker="elsewhere")
    assert lease is not None
    return lease.run


@pytest.fixture
def published_elsewhere(monkeypatch, django_user_model):
    """Publish as another process does: what it reads and forgets at its commit is its own
    process's, not this one's."""

    def _publish():
        ada = _user_in(django_user_model, "ada", "admin")
        bea = _user_in(django_user_model, "bea", "admin")
        with monkeypatch.context() as patched:
            patched.setattr(approvals_gate.published_tools, "forget", lambda: None)
            patched.setattr(configcache, "refresh", lambda: None)
            version, _ = publish(bea, draft(ada))
        return version

    return _publish


def test_a_tool_no_data_policy_governs_is_decided_with_no_query(refund_run):
    _decide(refund_run, 100)  # the first decision reads the index and the principal once
    with CaptureQueriesContext(connection) as queries:
        verdict, facts = _decide(refund_run, 100)
    assert queries.captured_queries == []
    assert not verdict.denied and facts["principal"] == "olga" and "operator" in facts["groups"]


def test_a_claim_reads_nothing_again_when_nothing_changed(olga, sandbox):
    _decide(_next_claim(olga), 100)  # read once, at the generations this claim returned
    run = _next_claim(olga)
    with CaptureQueriesContext(connection) as queries:
        _decide(run, 100)
    assert queries.captured_queries == []


def test_a_version_published_here_applies_to_the_next_decision(
    refund_run, django_user_model, django_capture_on_commit_callbacks
):
    before, _ = _decide(refund_run, 6000)
    ada = _user_in(django_user_model, "ada", "admin")
    bea = _user_in(django_user_model, "bea", "admin")
    with django_capture_on_commit_callbacks(execute=True):
        version, _ = publish(bea, draft(ada))
    verdict, _ = _decide(refund_run, 6000)  # no claim in between
    assert verdict.needs_approval and verdict.policy_version == version.id
    assert verdict.requirement.required == 2 and before.policy_version is None


def test_a_version_published_elsewhere_applies_from_the_next_claim(
    olga, sandbox, published_elsewhere
):
    claimed = _next_claim(olga)
    assert _decide(claimed, 6000)[0].policy_version is None  # read: no data policy
    version = published_elsewhere()
    # a slice already running keeps what its claim saw...
    assert _decide(claimed, 6000)[0].policy_version is None
    run = _next_claim(olga)  # ...the next claim anywhere sees the new generation
    verdict, _ = _decide(run, 6000)
    assert verdict.needs_approval and verdict.policy_version == version.id
    # a tool that has a data policy has its current version read afresh at each decision:
    # a withdrawal elsewhere applies at once, and the next claim drops the tool from the index
    ApprovalPolicyVersion.objects.filter(id=version.id).update(status="superseded")
    assert _decide(run, 6000)[0].policy_version is None
    run = _next_claim(olga)
    with CaptureQueriesContext(connection) as queries:
        _decide(run, 6000)
    assert len(queries.captured_queries) == 1  # the index, read again once; no version query


def _add_with_the_manager(user, group):
    user.groups.add(group)


def _add_through_the_table(user, group):
    user.groups.through.objects.create(user=user, group=group)


def _add_in_raw_sql(user, group):
    table = user.groups.through._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (user_id, group_id) VALUES (%s, %s)", [user.pk, group.pk]
        )


def _set_as_the_admin_form_does(user, group):
    user.groups.set([*user.groups.all(), group])


@pytest.mark.parametrize(
    "add",
    [_add_with_the_manager, _add_through_the_table, _add_in_raw_sql, _set_as_the_admin_form_does],
)
def test_a_principals_new_group_is_seen_at_the_next_claim(add, olga, sandbox):
    from django.contrib.auth.models import Group

    claimed = _next_claim(olga)
    assert "finance" not in policy_facts(claimed)["groups"]
    finance, _ = Group.objects.get_or_create(name="finance")
    add(olga, finance)
    assert "finance" not in policy_facts(claimed)["groups"]  # until a claim
    assert "finance" in policy_facts(_next_claim(olga))["groups"]


def test_a_removed_group_a_renamed_group_and_a_new_name_are_seen_at_the_next_claim(olga, sandbox):
    from django.contrib.auth.models import Group

    assert policy_facts(_next_claim(olga))["groups"] == ["operator"]
    Group.objects.filter(name="operator").update(name="operators")
    assert policy_facts(_next_claim(olga))["groups"] == ["operators"]
    olga.groups.clear()
    assert policy_facts(_next_claim(olga))["groups"] == []
    type(olga).objects.filter(pk=olga.pk).update(username="olga.k")
    assert policy_facts(_next_claim(olga))["principal"] == "olga.k"


# the engine's checkpoint refuses without a savepoint: a test transaction would be left broken
@pytest.mark.django_db(transaction=True)
def test_a_version_committed_elsewhere_governs_the_next_run_a_worker_claims(
    sandbox, published_elsewhere, django_user_model
):
    """Committed, through the real engine: the worker had read the index before."""
    owner = _user_in(django_user_model, "olga", "operator")
    assert _decide(_refund(owner), 6000)[0].policy_version is None
    version = published_elsewhere()
    run = drive(_refund(owner, 6000).id)
    assert run.status == Run.Status.WAITING_APPROVAL
    approval = Approval.objects.get(run=run, status="pending")
    assert approval.policy_version_id == version.id and approval.required_count == 2


@pytest.mark.django_db(transaction=True)
def test_a_call_that_needs_approval_asks_for_it_with_nothing_read_on_the_way(sandbox, system_actor):
    """Nothing is read between the decision and the request of its approval, so the call is
    not written yet when the gate asks whether it replaces an earlier approval (chaos
    through PgBouncer found the request failing on that)."""
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1004", "amount_cents": 50_000},
        actor=system_actor,
    )
    run = drive(run.id)
    assert run.status == Run.Status.WAITING_APPROVAL
    assert Approval.objects.filter(run=run, status="pending").count() == 1


def test_a_slice_that_runs_on_reads_the_generations_again_after_a_second(
    olga, sandbox, published_elsewhere, monkeypatch
):
    claimed = _next_claim(olga)
    assert _decide(claimed, 6000)[0].policy_version is None
    version = published_elsewhere()
    with CaptureQueriesContext(connection) as queries:
        configcache.refresh_if_older()  # within a second of the claim: nothing is read
    assert queries.captured_queries == []
    assert _decide(claimed, 6000)[0].policy_version is None
    stale = time.monotonic() - configcache.SLICE_MAX_AGE_SECONDS - 0.1
    monkeypatch.setattr(configcache, "_noted_at", stale)
    with CaptureQueriesContext(connection) as queries:
        configcache.refresh_if_older()
    assert len(queries.captured_queries) == 1  # the generations, in one query
    verdict, _ = _decide(claimed, 6000)
    assert verdict.needs_approval and verdict.policy_version == version.id


def test_the_engine_looks_at_the_generations_between_the_steps_of_a_slice(refund_run, monkeypatch):
    looked = []
    monkeypatch.setattr(configcache, "refresh_if_older", lambda: looked.append(1))
    run = drive(refund_run.id)
    assert run.status == Run.Status.SUCCEEDED
    # before every step of a slice but its first (the claim has just read them)
    assert len(looked) >= run.steps.count() - 1 >= 1
