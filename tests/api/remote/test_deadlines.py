"""A dispatch's deadlines in the remote protocol (DESIGN §9, issue 15): dispatch answers them
(a repeat, also a concurrent one, the original); the pre-send check refuses a paused agent
whose lease was taken over or whose send deadline passed; an ``absent`` counts only from the
latest lookup begun after the landing deadline; ``resend: person`` and tools with no lookup
wait for a person; the client's loop against the real sandbox."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from django.conf import settings
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, connection
from rest_framework.test import APIClient

from agentops.client import Client, Found, LeaseLost, ToolContext
from agentops.wsgi import application
from approvals.models import Approval
from runs import remote
from runs.actors import DRIVE_REMOTE_RUN, Actor
from runs.models import Run, ToolCall
from tests.api.conftest import assert_error, client_for, token_for
from tests.api.remote_support import REFUND_SCHEMA, Agent, register_remote, remote_run
from tests.support import expire_lease, refund_posts, refunds, rewind

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

MANIFEST: dict[str, Any] = {
    "version": "1",
    "tools": [
        # the sandbox's refunds: no deduplication (nodedupe), a lookup by key
        {"name": "refund", "effect": "reconcilable", "argument_schema": REFUND_SCHEMA,
         "timeout": 1},
        {"name": "careful_refund", "effect": "reconcilable", "timeout": 1, "resend": "person"},
        # deduplicates nothing and cannot be looked up
        {"name": "ping", "effect": "idempotent", "honours_key": False, "timeout": 1},
        {"name": "charge", "effect": "idempotent", "timeout": 1},
    ],
}  # fmt: skip


@pytest.fixture
def run(admin, operator, robot) -> Run:
    register_remote(admin, "deadline_bot", MANIFEST, owner=robot)
    return remote_run(operator, "deadline_bot")


_tokens = iter(range(1, 10**6))


def _client(user) -> APIClient:
    """Another process's client (a token of its own)."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user, f'proc-{next(_tokens)}')}")
    return client


def _dispatched(agent: Agent, tool: str = "refund", arguments: dict | None = None) -> dict:
    arguments = arguments if arguments is not None else {"order_id": "o", "amount_cents": 5}
    call = agent.propose(tool, arguments).json()["tool_call"]
    return agent.dispatch(call["id"]).json()


def _taken_over(run: Run, robot) -> Agent:
    """The first process froze; its lease expired and a second process claimed the run."""
    expire_lease(run.id)
    second = Agent(_client(robot), run.id)
    assert second.lease().status_code == 200
    return second


# --- dispatch answers its deadlines ------------------------------------------------------------


def test_dispatch_answers_deadlines_and_a_repeat_the_original(run, leased):
    first = _dispatched(leased)
    assert first["go"] is True and first["replayed"] is False and first["fence"] == leased.fence
    assert first["send_deadline"] < first["landing_deadline"]
    assert first["dispatched_at"] < first["send_deadline"] and first["timeout_seconds"] == 1.0
    call = ToolCall.objects.get(id=first["tool_call"]["id"])
    # computed by the database in the dispatching statement: send window, then timeout + margin
    send_window = min(settings.AGENTOPS["SEND_WINDOW"], settings.AGENTOPS["LEASE_TTL"])
    assert (call.send_deadline - call.dispatched_at).total_seconds() == pytest.approx(send_window)
    landing = send_window + 1 + settings.AGENTOPS["REDISPATCH_MARGIN"]
    assert (call.landing_deadline - call.dispatched_at).total_seconds() == pytest.approx(landing)

    again = leased.dispatch(call.id).json()
    assert again["replayed"] is True and again["attempt"] == 1
    for field in ("dispatched_at", "send_deadline", "landing_deadline", "idempotency_key"):
        assert again[field] == first[field]


# --- the pre-send check --------------------------------------------------------------------------


def test_send_check_clears_the_current_dispatch_in_one_query(
    run, leased, robot, django_assert_num_queries
):
    dispatch = _dispatched(leased)
    answer = leased.send_check(dispatch["tool_call"]["id"], dispatch["attempt"])
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["send_deadline"] == dispatch["send_deadline"]
    assert body["landing_deadline"] == dispatch["landing_deadline"]
    assert 0 < body["send_seconds_left"] <= settings.AGENTOPS["SEND_WINDOW"]

    actor = Actor.for_user(robot, "api")
    actor.require(DRIVE_REMOTE_RUN)  # the permission cache, as a request's user has it
    with django_assert_num_queries(1):
        remote.remote_toolcall_send_check(
            tool_call_id=dispatch["tool_call"]["id"],
            fence=leased.fence,
            lease_token=leased.lease_token,
            attempt=1,
            actor=actor,
        )


def test_send_check_refuses_a_paused_agent_whose_lease_was_taken_over(robot, run, leased, operator):
    dispatch = _dispatched(leased)
    second = _taken_over(run, robot)
    # the paused process wakes up: it must not send
    refused = leased.send_check(dispatch["tool_call"]["id"], dispatch["attempt"])
    assert_error(refused, 409, "lease_lost")
    assert second.resume["unknown_outcomes"][0]["id"] == dispatch["tool_call"]["id"]


def test_send_check_refuses_after_the_send_deadline(run, leased):
    dispatch = _dispatched(leased)
    rewind(run.id, seconds=settings.AGENTOPS["SEND_WINDOW"] + 0.1)
    refused = leased.send_check(dispatch["tool_call"]["id"], dispatch["attempt"])
    body = assert_error(refused, 409, "send_deadline_passed")
    call = ToolCall.objects.get(id=dispatch["tool_call"]["id"])
    assert httpx_time(body["send_deadline"]) == call.send_deadline
    assert httpx_time(body["resend_after"]) == call.landing_deadline
    # the honest report: the request never left; still reconciled as an unknown outcome
    answer = leased.receipt(call.id, outcome="not_sent", result="send_deadline_passed")
    assert answer.json()["status"] == "unknown"
    assert answer.json()["last_error"].startswith("not sent (the agent's report of attempt 1)")


def test_send_check_refuses_another_attempt(run, leased):
    dispatch = _dispatched(leased)
    assert_error(leased.send_check(dispatch["tool_call"]["id"], 2), 409, "invalid_state")


def httpx_time(value: str):
    from django.utils.dateparse import parse_datetime

    return parse_datetime(value)


# --- lookups and absent -------------------------------------------------------------------------


def test_absent_must_name_its_latest_lookup(robot, run, leased, operator):
    dispatch = _dispatched(leased)
    call_id = dispatch["tool_call"]["id"]
    second = _taken_over(run, robot)
    rewind(run.id)

    missing = second.receipt(call_id, outcome="absent", source="reconciliation")
    assert "lookups" in assert_error(missing, 400, "lookup_required")["detail"]
    one = second.lookup(call_id).json()["lookup"]
    two = second.lookup(call_id).json()["lookup"]
    stale = second.receipt(call_id, outcome="absent", source="reconciliation", lookup=one)
    assert assert_error(stale, 409, "lookup_superseded")["latest_lookup"] == two
    assert ToolCall.objects.get(id=call_id).absent_lookup is None

    accepted = second.receipt(call_id, outcome="absent", source="reconciliation", lookup=two)
    assert accepted.status_code == 200
    again = second.receipt(call_id, outcome="absent", source="reconciliation", lookup=two)
    assert again.status_code == 200  # a retried report, recorded once
    assert ToolCall.objects.get(id=call_id).reconcile_attempts == 1
    assert second.dispatch(call_id).json()["attempt"] == 2


def test_an_accepted_absent_is_used_up_by_the_next_dispatch(robot, run, leased, operator):
    dispatch = _dispatched(leased)
    call_id = dispatch["tool_call"]["id"]
    second = _taken_over(run, robot)
    rewind(run.id)
    lookup = second.lookup(call_id).json()["lookup"]
    second.receipt(call_id, outcome="absent", source="reconciliation", lookup=lookup)
    assert second.dispatch(call_id).json()["attempt"] == 2
    second.receipt(call_id, outcome="unknown", result="timed out again")
    # the absent was about attempt 1: attempt 2 needs its own lookup after its own deadline
    assert_error(second.dispatch(call_id), 409, "reconcile_required")
    late = second.lookup(call_id).json()
    refused = second.receipt(
        call_id, outcome="absent", source="reconciliation", lookup=late["lookup"]
    )
    assert_error(refused, 409, "lookup_too_early")


def test_resend_person_parks_a_valid_absent_and_the_operator_needs_a_fresh_lookup(
    robot, run, leased, operator
):
    dispatch = _dispatched(leased, "careful_refund", {})
    call_id = dispatch["tool_call"]["id"]
    second = _taken_over(run, robot)
    rewind(run.id)
    lookup = second.lookup(call_id).json()["lookup"]
    parked = second.receipt(call_id, outcome="absent", source="reconciliation", lookup=lookup)
    assert parked.json()["run_status"] == "needs_attention"
    run.refresh_from_db()
    assert run.reason_code == "unknown_outcome" and "resend: person" in run.reason_detail

    # a person decides, not the agent
    resolved = client_for(operator).post(
        f"/api/v1/tool-calls/{call_id}/resolution/", {"outcome": "dispatch_again"}
    )
    assert resolved.status_code == 200, resolved.content
    third = Agent(second.client, run.id)
    assert third.lease().status_code == 200
    # the operator's "dispatch again" does not replace the lookup
    assert_error(third.dispatch(call_id), 409, "reconcile_required")
    fresh = third.lookup(call_id).json()
    answer = third.receipt(
        call_id, outcome="absent", source="reconciliation", lookup=fresh["lookup"]
    )
    assert answer.json()["run_status"] == "running"  # the person already decided
    assert third.dispatch(call_id).json()["attempt"] == 2


def test_a_tool_without_lookup_waits_for_a_person_and_the_landing_deadline(
    robot, run, leased, operator
):
    dispatch = _dispatched(leased, "ping", {})
    call_id = dispatch["tool_call"]["id"]
    leased.receipt(call_id, outcome="unknown", result="timed out")
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("needs_attention", "unknown_outcome")

    second = Agent(_client(robot), run.id)
    resolved = client_for(operator).post(
        f"/api/v1/tool-calls/{call_id}/resolution/", {"outcome": "dispatch_again"}
    )
    assert resolved.status_code == 200, resolved.content
    leased_again = second.lease()
    assert leased_again.status_code == 200, leased_again.content
    early = assert_error(second.dispatch(call_id), 409, "dispatch_too_early")
    assert httpx_time(early["resend_after"]) == ToolCall.objects.get(id=call_id).landing_deadline
    assert 0 < early["wait_seconds"] <= settings.AGENTOPS["SEND_WINDOW"] + 1 + 1
    rewind(run.id)
    assert second.dispatch(call_id).json()["go"] is True


def test_a_deduplicating_tool_is_sent_again_at_once(run, leased):
    dispatch = _dispatched(leased, "charge", {})
    leased.receipt(dispatch["tool_call"]["id"], outcome="unknown", result="reset")
    assert leased.dispatch(dispatch["tool_call"]["id"]).json()["attempt"] == 2


@pytest.mark.parametrize(
    ("spec", "field"),
    [({"honours_key": "yes"}, "honours_key"), ({"resend": "never"}, "resend")],
)
def test_manifest_refuses_bad_deadline_declarations(as_admin_client, spec, field):
    manifest = {"version": "1", "tools": [{"name": "t", "effect": "reconcilable", **spec}]}
    answer = as_admin_client.put("/api/v1/agents/bad_bot/", manifest, format="json")
    body = assert_error(answer, 400, "validation_error")
    assert any(field in message for message in body["fields"]["tools.0"])


@pytest.fixture
def as_admin_client(admin):
    return client_for(admin)


# --- concurrent identical dispatches (PostgreSQL: real concurrency) -----------------------------


def _race(robot, path: str, body: dict, n: int = 4) -> list[Any]:
    clients = [_client(robot) for _ in range(n)]
    barrier = threading.Barrier(n)
    answers: list[Any] = [None] * n

    def post(index: int) -> None:
        try:
            barrier.wait()
            answers[index] = clients[index].post(path, body, format="json")
        finally:
            connection.close()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return answers


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("approved", [False, True], ids=["proposed", "approved"])
def test_concurrent_identical_dispatches_answer_the_same(
    robot, run, leased, operator, as_approver, approved
):
    if connection.vendor != "postgresql":
        pytest.skip("SQLite serialises writers; the race needs PostgreSQL")
    arguments = {"order_id": "o", "amount_cents": 20000 if approved else 5}
    if approved:
        register_remote_with_approval(run)
    call = leased.propose("refund", arguments).json()["tool_call"]
    if approved:
        approval = Approval.objects.get(tool_call_id=call["id"])
        decided = as_approver.post(
            f"/api/v1/approvals/{approval.id}/decision/", {"decision": "approve"}
        )
        assert decided.status_code == 200, decided.content
        assert leased.lease().status_code == 200

    proof = {"fence": leased.fence, "lease_token": leased.lease_token}
    answers = _race(robot, f"/api/v1/tool-calls/{call['id']}/dispatch/", proof)
    assert [a.status_code for a in answers] == [200] * 4, [a.content for a in answers]
    bodies = [a.json() for a in answers]
    assert sorted(b["replayed"] for b in bodies) == [False, True, True, True]
    for field in ("attempt", "send_deadline", "landing_deadline", "idempotency_key"):
        assert len({str(b[field]) for b in bodies}) == 1, field
    stored = ToolCall.objects.get(id=call["id"])
    assert (stored.status, stored.attempt_count) == ("dispatching", 1)
    assert Run.objects.get(id=run.id).status == "running"
    if approved:
        assert Approval.objects.get(tool_call_id=call["id"]).consumed_at is not None


def register_remote_with_approval(run: Run) -> None:
    """``refund`` over 100.00 needs an approval in this variation of the manifest."""
    from runs.models import AgentManifest

    manifest = AgentManifest.objects.get(name="deadline_bot")
    tools = [dict(tool) for tool in manifest.tools]
    tools[0]["approval"] = {
        "when": {"argument": "amount_cents", "op": "gt", "value": 10000},
        "group": "approver",
    }
    AgentManifest.objects.filter(name="deadline_bot").update(tools=tools)


# --- the client's loop against the real sandbox (issue 15, scenario 3) -------------------------


@pytest.fixture
def in_process() -> Iterator[httpx.WSGITransport]:
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield httpx.WSGITransport(app=application)
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def short_windows(monkeypatch):
    # send window 0.3 s, tool timeout 1 s, margin 0.5 s: a landing window of 1.8 s
    monkeypatch.setitem(settings.AGENTOPS, "SEND_WINDOW", 0.3)


class SandboxRefund:
    """The refund tool and its lookup against the sandbox; ``latency_ms`` delays the first
    request's apply (the downstream answers after the tool's timeout)."""

    def __init__(self, sandbox, *, latency_ms: int = 0, fault: str = "") -> None:
        self.url = sandbox.url
        self.fault = fault or (f"latency={latency_ms}" if latency_ms else "")
        self.lookups: list[str] = []

    def call(self, arguments, ctx: ToolContext) -> dict:
        headers = {"X-Sandbox-Fault": self.fault} if self.fault else {}
        self.fault = ""  # only the first request
        body = {"idempotency_key": ctx.idempotency_key, **arguments}
        response = ctx.request("POST", f"{self.url}/refunds", json=body, headers=headers)
        if response.status_code >= 500:
            from agentops.client import OutcomeUnknown

            raise OutcomeUnknown(f"answered {response.status_code}")
        return response.json()

    def lookup(self, key: str, arguments) -> Found:
        body = httpx.get(f"{self.url}/refunds", params={"idempotency_key": key}, timeout=5).json()
        self.lookups.append("found" if body["found"] else "absent")
        if body["found"]:
            return Found("found", body["refunds"][0], body["refunds"][0]["refund_id"])
        return Found("absent")


def test_a_late_landing_request_is_found_by_the_lookup_after_the_window(
    robot, run, operator, sandbox, in_process, short_windows, monkeypatch
):
    """Scenario 3: the downstream applies the refund after the tool's timeout. The agent's
    first lookup (inside the landing window) finds nothing; its absent is refused with
    lookup_too_early; the lookup after the window finds the refund: one refund, never two.
    The refund lands 1.5 s after the tool's timeout (the first lookup comes right after the
    timeout, even on a loaded machine) and 1.3 s before the window ends (margin 2.5 s)."""
    monkeypatch.setitem(settings.AGENTOPS, "REDISPATCH_MARGIN", 2.5)
    tool = SandboxRefund(sandbox, latency_ms=2500)
    with Client("http://testserver", token_for(robot), transport=in_process) as client:
        lease = client.lease(str(run.id))
        proposal = lease.propose("refund", {"order_id": "ord_1001", "amount_cents": 5})
        done = lease.execute(proposal.tool_call_id, tool.call, lookup=tool.lookup)
    assert done.outcome == "succeeded" and done.source == "reconciliation", done
    assert tool.lookups == ["absent", "found"]
    assert len(refunds(sandbox)) == 1 and len(refund_posts(sandbox)) == 1
    call = ToolCall.objects.get(id=proposal.tool_call_id)
    assert (call.status, call.attempt_count, call.lookups_begun) == ("succeeded", 1, 2)
    assert call.lookup_started_at >= call.landing_deadline  # the lookup that decided


def test_an_absent_after_the_window_is_sent_again_with_the_same_key(
    robot, run, operator, sandbox, in_process, short_windows
):
    """The first request never applied (the service failed it ambiguously): the lookup in the
    window is refused, the one after it is accepted, and the same key goes again once."""
    tool = SandboxRefund(sandbox, fault="5xx")
    with Client("http://testserver", token_for(robot), transport=in_process) as client:
        lease = client.lease(str(run.id))
        proposal = lease.propose("refund", {"order_id": "ord_1001", "amount_cents": 5})
        done = lease.execute(proposal.tool_call_id, tool.call, lookup=tool.lookup)
    assert done.outcome == "succeeded" and done.source == "agent", done
    assert tool.lookups == ["absent", "absent"]
    posts = refund_posts(sandbox)
    assert len(posts) == 2 and posts[0]["idempotency_key"] == posts[1]["idempotency_key"]
    assert len(refunds(sandbox)) == 1
    call = ToolCall.objects.get(id=proposal.tool_call_id)
    assert (call.status, call.attempt_count) == ("succeeded", 2)


def test_client_never_sends_once_its_lease_was_taken_over(
    robot, run, operator, sandbox, in_process, short_windows
):
    with Client("http://testserver", token_for(robot), transport=in_process) as client:
        lease = client.lease(str(run.id))
        proposal = lease.propose("refund", {"order_id": "ord_1001", "amount_cents": 5})
        dispatch = lease.dispatch(proposal.tool_call_id)
        # while this process was frozen, its lease expired and another process claimed it
        expire_lease(run.id)
        remote.remote_lease_acquire(run_id=run.id, actor=Actor.for_user(robot, "api"))
        with pytest.raises(LeaseLost):
            lease.send_check(dispatch)
    assert refund_posts(sandbox) == []


def test_new_answers_conform_to_the_schema(robot, run, in_process):
    """Dispatch, the pre-send check, a lookup, and receipts refused with the new codes and
    their fields, checked against the OpenAPI schema (all through the WSGI app: Django's
    test client would reconnect the signal that closes the connection after a request)."""
    api = schemathesis.openapi.from_wsgi("/api/schema/", application)
    headers = {"Authorization": f"Bearer {token_for(robot, 'schema')}"}
    base = "/api/v1/tool-calls/{tool_call_id}"
    with httpx.Client(base_url="http://testserver", transport=in_process, headers=headers) as http:
        # leased once the schema is built: that may take longer than the tests' 3 s lease
        leased = http.post(f"/api/v1/runs/{run.id}/lease/", json={"owner": "proc-1"}).json()
        fence = {"fence": leased["fence"], "lease_token": leased["lease_token"]}
        proposed = http.post(
            f"/api/v1/runs/{run.id}/tool-calls/",
            json={**fence, "tool": "refund", "arguments": {"order_id": "o", "amount_cents": 5}},
        )
        assert proposed.status_code == 201, proposed.content
        call_id = proposed.json()["tool_call"]["id"]
        path = f"/api/v1/tool-calls/{call_id}"
        answers = {
            f"{base}/dispatch/": [http.post(f"{path}/dispatch/", json=fence) for _ in range(2)],
            f"{base}/send-check/": [
                http.post(f"{path}/send-check/", json={**fence, "attempt": 1}),
                http.post(f"{path}/send-check/", json={**fence, "attempt": 2}),
            ],
        }
        lookup = http.post(f"{path}/lookups/", json=fence)
        assert lookup.status_code == 201, lookup.content
        answers[f"{base}/lookups/"] = [lookup]
        absent = {**fence, "outcome": "absent", "source": "reconciliation"}
        answers[f"{base}/receipt/"] = [
            http.post(f"{path}/receipt/", json=absent),
            http.post(f"{path}/receipt/", json={**absent, "lookup": lookup.json()["lookup"]}),
            http.post(f"{path}/receipt/", json={**fence, "outcome": "succeeded", "result": {}}),
        ]
    codes = {p: [a.status_code for a in responses] for p, responses in answers.items()}
    assert codes == {
        f"{base}/dispatch/": [200, 200],
        f"{base}/send-check/": [200, 409],
        f"{base}/lookups/": [201],
        f"{base}/receipt/": [400, 409, 200],
    }
    assert answers[f"{base}/receipt/"][1].json()["code"] == "lookup_too_early"
    for schema_path, responses in answers.items():
        for response in responses:
            api[schema_path]["POST"].validate_response(response)
