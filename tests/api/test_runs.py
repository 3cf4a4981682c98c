"""Runs over the API: start (with Idempotency-Key), list, read, events, pause, resume,
terminate; each with its success, permission and bad-input cases."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from runs.models import IdempotentRequest, Run, RunEvent
from runs.registry import registry
from tests.api.conftest import assert_error, client_for, start
from tests.support import event_types

# each request commits or rolls back on its own, as in production (a service error
# rolls back the whole transaction it opened)
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]

PAY = {"agent": "api_payer", "goal": "pay", "input": {"amount_cents": 500}}


# --- health and agents ----------------------------------------------------------------------


def test_health_needs_no_auth(anonymous):
    response = anonymous.get("/api/v1/health/")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok"}


def test_health_ignores_a_bad_token(anonymous):
    anonymous.credentials(HTTP_AUTHORIZATION="Bearer nope")
    assert anonymous.get("/api/v1/health/").status_code == 200


def test_agents_lists_tools_with_effect_policy_and_sensitive_fields(as_viewer, api_agents):
    response = as_viewer.get("/api/v1/agents/")

    assert response.status_code == 200
    agents = {agent["name"]: agent for agent in response.json()}
    payer = agents["api_payer"]
    assert payer["kind"] == "hosted"
    assert payer["input_schema"]["required"] == ["amount_cents"]
    (tool,) = payer["tools"]
    assert tool["name"] == "api_pay"
    assert tool["effect"] == "idempotent"
    assert tool["sensitive_fields"] == ["card"]
    assert tool["approval"]["when"] == "always"
    assert tool["approval"]["group"] == "approver"
    assert tool["timeout"] == 1.0
    # the fingerprint every call of the tool records (docs/agents.md)
    assert tool["version"] == registry.tool("api_pay").version
    assert (tool["declared_version"], tool["compatible_with"]) == ("", [])
    assert "refund" in agents  # the demo agents are registered too


def test_agents_needs_auth(anonymous):
    assert_error(anonymous.get("/api/v1/agents/"), 401, "not_authenticated")


# --- create ---------------------------------------------------------------------------------


def test_create_starts_a_run_as_the_token_principal(as_operator, operator, api_agents):
    body = {**PAY, "budget": {"max_steps": 5, "max_cost": "1.50", "max_tokens": 1000}}

    response = as_operator.post("/api/v1/runs/", body)

    assert response.status_code == 201, response.json()
    data = response.json()
    run = Run.objects.get(id=data["id"])
    assert (run.agent_name, run.status, run.principal) == ("api_payer", "queued", operator)
    assert data["budget"] == {
        "max_steps": 5,
        "max_cost": "1.500000",
        "max_tokens": 1000,
        "deadline": None,
    }
    assert data["usage"] == {"steps": 0, "cost": "0.000000", "tokens": 0}
    assert data["principal"] == operator.username
    assert event_types(run.id) == ["run.created"]


def test_create_with_a_deadline(as_operator, api_agents):
    deadline = (timezone.now() + timedelta(hours=1)).isoformat()

    response = as_operator.post("/api/v1/runs/", {**PAY, "budget": {"deadline": deadline}})

    assert response.status_code == 201
    assert Run.objects.get(id=response.json()["id"]).deadline is not None


def test_create_needs_start_permission(as_viewer, api_agents):
    assert_error(as_viewer.post("/api/v1/runs/", PAY), 403, "permission_denied")
    assert not Run.objects.exists()


def test_create_unknown_agent(as_operator):
    body = assert_error(
        as_operator.post("/api/v1/runs/", {**PAY, "agent": "nope"}), 400, "unknown_agent"
    )
    assert body["detail"] == "unknown agent 'nope'"  # quotes balanced (issue 21)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "agent"),
        ({"agent": "api_payer", "input": []}, "input"),
        ({"agent": "api_payer", "budget": {"max_steps": 0}}, "budget.max_steps"),
        ({"agent": "api_payer", "budget": {"max_cost": "-1"}}, "budget.max_cost"),
        ({"agent": "api_payer", "budget": {"deadline": "2000-01-01T00:00:00Z"}}, "budget.deadline"),
        ({"agent": "api_payer", "goal": 12 * "x" * 1000}, "goal"),
    ],
)
def test_create_bad_input_names_the_field(as_operator, api_agents, body, field):
    response = as_operator.post("/api/v1/runs/", body)

    data = assert_error(response, 400, "validation_error")
    assert field in data["fields"], data
    assert not Run.objects.exists()


def test_create_input_not_matching_the_agent_schema(as_operator, api_agents):
    response = as_operator.post("/api/v1/runs/", {**PAY, "input": {"amount_cents": 0}})

    data = assert_error(response, 400, "validation_error")
    assert "amount_cents" in data["detail"]
    assert not Run.objects.exists()


def test_same_idempotency_key_and_body_returns_the_same_run(as_operator, api_agents):
    first = as_operator.post("/api/v1/runs/", PAY, HTTP_IDEMPOTENCY_KEY="k-1")
    # same body, other key order
    again = as_operator.post(
        "/api/v1/runs/", dict(reversed(list(PAY.items()))), HTTP_IDEMPOTENCY_KEY="k-1"
    )

    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    assert Run.objects.count() == 1


def test_same_idempotency_key_with_another_body_is_refused(as_operator, api_agents):
    as_operator.post("/api/v1/runs/", PAY, HTTP_IDEMPOTENCY_KEY="k-1")

    response = as_operator.post(
        "/api/v1/runs/", {**PAY, "goal": "other"}, HTTP_IDEMPOTENCY_KEY="k-1"
    )

    assert_error(response, 409, "idempotency_key_reused")
    assert Run.objects.count() == 1


def test_idempotency_keys_are_per_principal(as_operator, api_agents, django_user_model):
    from django.contrib.auth.models import Group

    other = django_user_model.objects.create_user("otto")
    other.groups.add(Group.objects.get(name="operator"))
    as_other = client_for(other)

    a = as_operator.post("/api/v1/runs/", PAY, HTTP_IDEMPOTENCY_KEY="k-1")
    b = as_other.post("/api/v1/runs/", PAY, HTTP_IDEMPOTENCY_KEY="k-1")

    assert (a.status_code, b.status_code) == (201, 201)
    assert a.json()["id"] != b.json()["id"]


def test_failed_create_does_not_burn_the_idempotency_key(as_operator, api_agents):
    bad = as_operator.post(
        "/api/v1/runs/", {**PAY, "input": {"amount_cents": 0}}, HTTP_IDEMPOTENCY_KEY="k-1"
    )
    assert_error(bad, 400, "validation_error")

    good = as_operator.post("/api/v1/runs/", PAY, HTTP_IDEMPOTENCY_KEY="k-1")

    assert good.status_code == 201
    assert IdempotentRequest.objects.get(key="k-1").run_id == uuid.UUID(good.json()["id"])


def test_too_long_idempotency_key(as_operator, api_agents):
    response = as_operator.post("/api/v1/runs/", PAY, HTTP_IDEMPOTENCY_KEY="k" * 201)
    data = assert_error(response, 400, "validation_error")
    assert "Idempotency-Key" in data["fields"]


# --- list and detail ------------------------------------------------------------------------


def test_list_filters_and_paginates_newest_first(as_viewer, api_agents):
    runs = [start() for _ in range(3)]
    other = start("api_sender")
    Run.objects.filter(id=runs[0].id).update(status=Run.Status.PAUSED)

    page = as_viewer.get("/api/v1/runs/", {"limit": 2}).json()
    assert [r["id"] for r in page["results"]] == [str(other.id), str(runs[2].id)]
    rest = as_viewer.get(page["next"]).json()
    assert [r["id"] for r in rest["results"]] == [str(runs[1].id), str(runs[0].id)]
    assert rest["next"] is None

    by_agent = as_viewer.get("/api/v1/runs/", {"agent": "api_sender"}).json()["results"]
    assert [r["id"] for r in by_agent] == [str(other.id)]
    paused = as_viewer.get("/api/v1/runs/", {"status": "paused"}).json()["results"]
    assert [r["id"] for r in paused] == [str(runs[0].id)]


def test_list_query_count_does_not_grow_with_runs(as_viewer, api_agents, django_assert_num_queries):
    for _ in range(5):
        start()
    as_viewer.get("/api/v1/runs/")  # warm the token's last_used_at
    # token, permissions (user perms + group perms), the page
    with django_assert_num_queries(4):
        assert len(as_viewer.get("/api/v1/runs/").json()["results"]) == 5


def test_list_bad_status(as_viewer):
    data = assert_error(as_viewer.get("/api/v1/runs/", {"status": "nope"}), 400, "validation_error")
    assert "status" in data["fields"]


def test_list_bad_cursor(as_viewer):
    data = assert_error(as_viewer.get("/api/v1/runs/", {"cursor": "zzz"}), 400, "validation_error")
    assert "cursor" in data["fields"]


def test_list_needs_view_permission(django_user_model):
    nobody = django_user_model.objects.create_user("nobody")
    assert_error(client_for(nobody).get("/api/v1/runs/"), 403, "permission_denied")


def test_detail(as_viewer, api_agents):
    run = start()

    data = as_viewer.get(f"/api/v1/runs/{run.id}/").json()

    assert data["id"] == str(run.id)
    assert data["input"] == {"amount_cents": 500}
    assert data["status"] == "queued"
    assert data["root_run"] == str(run.id)


def test_detail_not_found(as_viewer):
    assert_error(as_viewer.get(f"/api/v1/runs/{uuid.uuid4()}/"), 404, "not_found")


def test_detail_needs_view_permission(django_user_model, api_agents):
    run = start()
    nobody = django_user_model.objects.create_user("nobody")
    assert_error(client_for(nobody).get(f"/api/v1/runs/{run.id}/"), 403, "permission_denied")


# --- events ---------------------------------------------------------------------------------


def test_events_paginate_by_seq(as_viewer, waiting_run):
    seqs = list(RunEvent.objects.filter(run=waiting_run).values_list("seq", flat=True))
    assert len(seqs) >= 3

    first = as_viewer.get(f"/api/v1/runs/{waiting_run.id}/events/", {"limit": 2}).json()
    assert [e["seq"] for e in first["results"]] == [1, 2]
    assert first["last_seq"] == 2
    seen, page = [1, 2], first
    while page["next"]:
        page = as_viewer.get(page["next"]).json()
        assert len(page["results"]) <= 2
        seen += [e["seq"] for e in page["results"]]
    assert seen == seqs

    resumed = as_viewer.get(
        f"/api/v1/runs/{waiting_run.id}/events/", {"after_seq": seqs[-1]}
    ).json()
    assert resumed == {"next": None, "last_seq": seqs[-1], "results": []}


def test_events_mask_sensitive_arguments(as_viewer, waiting_run):
    events = as_viewer.get(f"/api/v1/runs/{waiting_run.id}/events/").json()["results"]

    assert "4242-4242-SECRET" not in str(events)
    assert "***" in str(events)


def test_events_bad_input(as_viewer, waiting_run):
    url = f"/api/v1/runs/{waiting_run.id}/events/"
    assert (
        "after_seq"
        in assert_error(as_viewer.get(url, {"after_seq": -1}), 400, "validation_error")["fields"]
    )
    assert (
        "limit" in assert_error(as_viewer.get(url, {"limit": 0}), 400, "validation_error")["fields"]
    )
    assert_error(as_viewer.get(f"/api/v1/runs/{uuid.uuid4()}/events/"), 404, "not_found")


def test_events_need_view_permission(django_user_model, waiting_run):
    nobody = django_user_model.objects.create_user("nobody")
    response = client_for(nobody).get(f"/api/v1/runs/{waiting_run.id}/events/")
    assert_error(response, 403, "permission_denied")


# --- pause, resume, terminate ---------------------------------------------------------------


def test_pause_then_resume(as_operator, api_agents):
    run = start()

    paused = as_operator.post(f"/api/v1/runs/{run.id}/pause/", {"reason": "look first"})
    assert (paused.status_code, paused.json()["status"]) == (200, "paused")
    resumed = as_operator.post(f"/api/v1/runs/{run.id}/resume/")
    assert (resumed.status_code, resumed.json()["status"]) == (200, "queued")

    events = RunEvent.objects.filter(run=run, type__in=["run.paused", "run.resumed"])
    assert {(e.type, e.channel, e.actor) for e in events} == {
        ("run.paused", "api", "token:token-olivia"),
        ("run.resumed", "api", "token:token-olivia"),
    }


def test_pause_without_a_body(as_operator, api_agents):
    run = start()
    assert as_operator.post(f"/api/v1/runs/{run.id}/pause/").json()["status"] == "paused"


def test_pause_and_resume_in_the_wrong_state(as_operator, api_agents):
    run = start()
    assert_error(as_operator.post(f"/api/v1/runs/{run.id}/resume/"), 409, "invalid_state")
    as_operator.post(f"/api/v1/runs/{run.id}/terminate/", {"reason": "done"})
    assert_error(as_operator.post(f"/api/v1/runs/{run.id}/pause/"), 409, "invalid_state")


def test_pause_resume_terminate_need_operate_permission(as_viewer, api_agents):
    run = start()
    for action, body in [("pause", {}), ("resume", {}), ("terminate", {"reason": "x"})]:
        response = as_viewer.post(f"/api/v1/runs/{run.id}/{action}/", body)
        assert_error(response, 403, "permission_denied")
    assert Run.objects.get(id=run.id).status == "queued"


def test_actions_on_a_missing_run(as_operator):
    missing = uuid.uuid4()
    for action, body in [("pause", {}), ("resume", {}), ("terminate", {"reason": "x"})]:
        assert_error(as_operator.post(f"/api/v1/runs/{missing}/{action}/", body), 404, "not_found")


def test_terminate(as_operator, waiting_run):
    response = as_operator.post(f"/api/v1/runs/{waiting_run.id}/terminate/", {"reason": "wrong"})

    assert response.status_code == 200
    data = response.json()
    assert (data["status"], data["reason_code"], data["reason_detail"]) == (
        "terminated",
        "operator_terminated",
        "wrong",
    )
    event = RunEvent.objects.get(run=waiting_run, type="run.terminated")
    assert (event.channel, event.payload["reason"]) == ("api", "wrong")


@pytest.mark.parametrize(
    "body", [{}, {"reason": ""}, {"reason": "   "}, {"reason": 5 * "x" * 1000}]
)
def test_terminate_needs_a_reason(as_operator, api_agents, body):
    run = start()
    data = assert_error(
        as_operator.post(f"/api/v1/runs/{run.id}/terminate/", body), 400, "validation_error"
    )
    assert "reason" in data["fields"]
    assert Run.objects.get(id=run.id).status == "queued"


def test_terminate_twice(as_operator, api_agents):
    run = start()
    as_operator.post(f"/api/v1/runs/{run.id}/terminate/", {"reason": "x"})
    response = as_operator.post(f"/api/v1/runs/{run.id}/terminate/", {"reason": "x"})
    assert_error(response, 409, "invalid_state")


# --- budget, retry-recovery, fork (issue 3 services) ---------------------------------------


def _stop(run: Run, reason_code: str, **fields) -> None:
    Run.objects.filter(id=run.id).update(
        status=Run.Status.NEEDS_ATTENTION, reason_code=reason_code, **fields
    )


def test_budget_top_up_requeues_an_exhausted_run(as_operator, api_agents):
    run = start()
    _stop(run, "budget_exhausted", max_steps=1, steps_used=1)

    response = as_operator.post(f"/api/v1/runs/{run.id}/budget/", {"add_steps": 5})

    assert response.status_code == 200, response.json()
    data = response.json()
    assert (data["status"], data["budget"]["max_steps"]) == ("queued", 6)
    event = RunEvent.objects.get(run=run, type="run.budget_topped_up")
    assert event.channel == "api"


def test_budget_top_up_that_leaves_it_exhausted(as_operator, api_agents):
    run = start()
    past = timezone.now() - timedelta(minutes=1)
    _stop(run, "budget_exhausted", deadline=past)

    response = as_operator.post(f"/api/v1/runs/{run.id}/budget/", {"add_steps": 5})

    assert_error(response, 409, "budget_exhausted")
    assert Run.objects.get(id=run.id).status == Run.Status.NEEDS_ATTENTION


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "non_field_errors"),
        ({"add_steps": -1}, "add_steps"),
        ({"add_cost": "-0.5"}, "add_cost"),
        ({"add_tokens": "many"}, "add_tokens"),
        ({"deadline": "2000-01-01T00:00:00Z"}, "non_field_errors"),
    ],
)
def test_budget_bad_input(as_operator, api_agents, body, field):
    run = start()
    data = assert_error(
        as_operator.post(f"/api/v1/runs/{run.id}/budget/", body), 400, "validation_error"
    )
    assert field in data["fields"], data


def test_budget_wrong_state_permission_and_missing(as_operator, as_viewer, api_agents):
    run = start()
    as_operator.post(f"/api/v1/runs/{run.id}/terminate/", {"reason": "x"})
    url = f"/api/v1/runs/{run.id}/budget/"
    assert_error(as_operator.post(url, {"add_steps": 1}), 409, "invalid_state")
    assert_error(as_viewer.post(url, {"add_steps": 1}), 403, "permission_denied")
    missing = f"/api/v1/runs/{uuid.uuid4()}/budget/"
    assert_error(as_operator.post(missing, {"add_steps": 1}), 404, "not_found")


def test_retry_recovery(as_operator, as_viewer, api_agents):
    run = start()
    url = f"/api/v1/runs/{run.id}/retry-recovery/"
    assert_error(as_operator.post(url), 409, "invalid_state")
    _stop(run, "recovery_limit", recovery_count=11)
    assert_error(as_viewer.post(url), 403, "permission_denied")

    response = as_operator.post(url)

    assert (response.status_code, response.json()["status"]) == (200, "queued")
    missing = f"/api/v1/runs/{uuid.uuid4()}/retry-recovery/"
    assert_error(as_operator.post(missing), 404, "not_found")


@pytest.fixture
def reader_run(api_agents) -> Run:
    """Step 1 (a read) completed, step 2 (a payment) waiting for approval."""
    from tests.conftest import drive

    run = drive(start("api_reader").id)
    assert run.status == Run.Status.WAITING_APPROVAL
    return run


def test_fork_from_a_finished_step(as_operator, reader_run):
    response = as_operator.post(f"/api/v1/runs/{reader_run.id}/fork/", {"from_step": 1})

    assert response.status_code == 201, response.json()
    fork = response.json()
    assert fork["id"] != str(reader_run.id)
    assert (fork["root_run"], fork["status"]) == (str(reader_run.id), "queued")
    assert Run.objects.get(id=reader_run.id).status == Run.Status.TERMINATED


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "from_step"),
        ({"from_step": 0}, "from_step"),
        ({"from_step": 2}, "non_field_errors"),  # still pending
        ({"from_step": 99}, "non_field_errors"),
        ({"from_step": 1, "agent_version": "7"}, "non_field_errors"),
    ],
)
def test_fork_bad_input(as_operator, reader_run, body, field):
    response = as_operator.post(f"/api/v1/runs/{reader_run.id}/fork/", body)
    data = assert_error(response, 400, "validation_error")
    assert field in data["fields"], data
    assert Run.objects.count() == 1


def test_fork_permission_and_missing(as_operator, as_viewer, reader_run):
    url = f"/api/v1/runs/{reader_run.id}/fork/"
    assert_error(as_viewer.post(url, {"from_step": 1}), 403, "permission_denied")
    missing = f"/api/v1/runs/{uuid.uuid4()}/fork/"
    assert_error(as_operator.post(missing, {"from_step": 1}), 404, "not_found")
