"""A remote lease belongs to the process its claim answered (issue 16, item 2): the claim
returns a secret lease token, stored hashed; every fenced write presents it with the fence;
another token, or another principal with the right token, is ``403 lease_not_yours`` and
changes nothing; events name the principal that wrote."""

from __future__ import annotations

import hashlib

import pytest

from runs.actors import Actor
from runs.models import Run, RunEvent, Step, ToolCall
from runs.remote import agent_manifest_put
from tests.api.conftest import assert_error, client_for
from tests.api.remote_support import MANIFEST, Agent
from tests.conftest import _user_in

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

FENCED = {
    "runs/{run}/lease/heartbeat/": {},
    "runs/{run}/lease/release/": {},
    "runs/{run}/steps/": {"state": {"taken": True}},
    "runs/{run}/tool-calls/": {"tool": "lookup", "arguments": {}},
    "runs/{run}/finish/": {"result": {"taken": True}},
    "runs/{run}/waits/": {"kind": "timer", "seconds": 1},
    "tool-calls/{call}/dispatch/": {},
    "tool-calls/{call}/send-check/": {"attempt": 1},
    "tool-calls/{call}/lookups/": {},
    "tool-calls/{call}/receipt/": {"outcome": "succeeded", "result": {"taken": True}},
}


def _snapshot(run: Run) -> tuple:
    """Everything a write could change."""
    stored = Run.objects.get(id=run.id)
    calls = list(ToolCall.objects.filter(run=run).values_list("id", "status", "attempt_count"))
    return (
        stored.event_seq,
        stored.status,
        stored.state,
        stored.lease_expires_at,
        stored.lease_owner,
        Step.objects.filter(run=run).count(),
        calls,
    )


@pytest.fixture
def dispatched(run, leased) -> int:
    """The lease holder dispatched a read call: every endpoint has something to act on."""
    call_id = leased.propose("lookup", {}).json()["tool_call"]["id"]
    assert leased.dispatch(call_id).status_code == 200
    return call_id


def test_the_claim_returns_a_token_the_record_keeps_only_hashed(run, leased):
    assert len(leased.lease_token) >= 40
    stored = Run.objects.get(id=run.id)
    assert stored.lease_token_hash == hashlib.sha256(leased.lease_token.encode()).hexdigest()
    recorded = [str(e.payload) for e in RunEvent.objects.filter(run=run)]
    assert not any(leased.lease_token in payload for payload in recorded)


@pytest.mark.parametrize("template", FENCED)
def test_a_guessed_token_writes_nothing(template, run, leased, dispatched):
    thief = Agent(leased.client, run.id)
    thief.fence, thief.lease_token = leased.fence, "guessed-" + leased.lease_token[8:]
    before = _snapshot(run)
    body = FENCED[template]
    response = thief.post(template.format(run=run.id, call=dispatched), body)
    assert_error(response, 403, "lease_not_yours")
    assert _snapshot(run) == before


@pytest.mark.parametrize("template", FENCED)
def test_another_service_account_in_the_agent_role_writes_nothing(
    template, run, leased, dispatched, django_user_model
):
    """Even with the fence and the token (copied from a log, or from a colleague's process),
    a principal that does not own the agent drives none of its runs."""
    other = _user_in(django_user_model, "otto", "agent")
    thief = Agent(client_for(other), run.id)
    thief.fence, thief.lease_token = leased.fence, leased.lease_token
    before = _snapshot(run)
    response = thief.post(template.format(run=run.id, call=dispatched), FENCED[template])
    assert_error(response, 403, "permission_denied")
    assert _snapshot(run) == before


@pytest.mark.parametrize("template", FENCED)
def test_a_new_owner_does_not_inherit_the_old_owners_lease(
    template, run, leased, dispatched, admin, django_user_model
):
    """An admin names another owner while the old one holds a lease: the old owner writes
    nothing more (permission_denied), and the new one writes nothing into that lease even
    with its token (lease_not_yours) — it claims its own when the lease ends."""
    successor = _user_in(django_user_model, "otto", "agent")
    manifest = {**MANIFEST, "owner": successor.username}
    agent_manifest_put(name="pay_bot", manifest=manifest, actor=Actor.for_user(admin, "cli"))
    before = _snapshot(run)
    path = template.format(run=run.id, call=dispatched)
    assert_error(leased.post(path, FENCED[template]), 403, "permission_denied")
    thief = Agent(client_for(successor), run.id)
    thief.fence, thief.lease_token = leased.fence, leased.lease_token
    assert_error(thief.post(path, FENCED[template]), 403, "lease_not_yours")
    assert _snapshot(run) == before


def test_a_retry_answered_from_the_record_needs_the_token_too(run, leased):
    """A retried step, wait or propose is answered from what its first attempt recorded:
    that answer is the holder's too."""
    assert leased.run_post("steps", {"output": {"plan": 1}, "seq": 1}).status_code == 201
    thief = Agent(leased.client, run.id)
    thief.fence, thief.lease_token = leased.fence, "not-the-token"
    assert_error(thief.run_post("steps", {"output": {"plan": 1}, "seq": 1}), 403, "lease_not_yours")
    parked = leased.propose("refund", {"order_id": "o", "amount_cents": 20000})
    assert parked.json()["decision"] == "awaiting_approval"  # the lease was released
    retried = thief.propose("refund", {"order_id": "o", "amount_cents": 20000})
    assert_error(retried, 403, "lease_not_yours")
    # the holder's own retry still gets its proposal
    assert leased.propose("refund", {"order_id": "o", "amount_cents": 20000}).status_code == 200


def test_a_zombie_of_an_earlier_claim_is_told_its_lease_is_lost(run, leased):
    """An earlier incarnation's fence with its own token is lease_lost (stop), as before."""
    assert leased.run_post("lease/release").status_code == 200
    second = Agent(leased.client, run.id)
    assert second.lease(owner="proc-2").status_code == 200
    assert second.lease_token != leased.lease_token
    assert_error(leased.run_post("steps", {}), 409, "lease_lost")
    # the new fence with the old token is not the new holder's
    leased.fence = second.fence
    assert_error(leased.run_post("steps", {}), 403, "lease_not_yours")
    assert second.run_post("steps", {}).status_code == 201


def test_events_name_the_principal_that_wrote(run, leased):
    assert leased.run_post("steps", {"output": {"plan": 1}}).status_code == 201
    holder = Run.objects.select_related("lease_holder").get(id=run.id).lease_holder
    event = RunEvent.objects.filter(run=run, type="step.decided").get()
    assert event.actor.startswith("token:") and event.actor.endswith("#proc-1")
    assert holder.username in event.actor


def test_is_lease_holder_names_only_the_live_holder(run, leased, robot, operator):
    """The predicate other code (masking) asks: the principal the claim answered, while its
    lease lives."""
    from runs.remote import is_lease_holder

    assert is_lease_holder(robot, Run.objects.get(id=run.id))
    assert not is_lease_holder(operator, Run.objects.get(id=run.id))
    assert not is_lease_holder(None, Run.objects.get(id=run.id))
    assert leased.run_post("lease/release").status_code == 200
    assert not is_lease_holder(robot, Run.objects.get(id=run.id))
