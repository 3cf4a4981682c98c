"""Dry runs over the API (issue 23 item 5): started with ``dry_run``, refused with
``dry_run_unsupported`` naming the tools, marked in every representation, and promoted to a
real run with ``POST /runs/{id}/promote/``."""

from __future__ import annotations

import pytest

from runs.models import Run
from tests.api.conftest import assert_error
from tests.conftest import drive
from tests.support import refund_posts

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]

REFUND = {"agent": "refund", "input": {"order_id": "ord_1002", "amount_cents": 700}}


def test_a_dry_run_is_started_listed_and_shown_as_one(as_operator):
    response = as_operator.post("/api/v1/runs/", {**REFUND, "dry_run": True}, format="json")

    assert response.status_code == 201, response.json()
    data = response.json()
    assert (data["dry_run"], data["promoted_from"], data["promoted_to"]) == (True, None, None)
    real = as_operator.post("/api/v1/runs/", REFUND, format="json").json()
    assert real["dry_run"] is False

    listed = as_operator.get("/api/v1/runs/").json()["results"]
    assert {run["id"]: run["dry_run"] for run in listed} == {data["id"]: True, real["id"]: False}
    only_dry = as_operator.get("/api/v1/runs/", {"dry_run": "true"}).json()["results"]
    assert [run["id"] for run in only_dry] == [data["id"]]
    events = as_operator.get(f"/api/v1/runs/{data['id']}/events/").json()["results"]
    assert events[0]["type"] == "run.created" and events[0]["payload"]["dry_run"] is True


def test_a_dry_run_of_an_agent_whose_tool_cannot_simulate_is_refused(as_operator, api_agents):
    response = as_operator.post(
        "/api/v1/runs/",
        {"agent": "api_reader", "input": {}, "dry_run": True},
        format="json",
    )

    body = assert_error(response, 400, "dry_run_unsupported")
    assert body["detail"].endswith("declare no dry_run: api_pay")  # not the read tool
    assert not Run.objects.filter(agent_name="api_reader").exists()


def test_promote_starts_a_finished_dry_run_for_real_once(as_operator, as_viewer, sandbox):
    dry = as_operator.post("/api/v1/runs/", {**REFUND, "dry_run": True}, format="json").json()
    url = f"/api/v1/runs/{dry['id']}/promote/"
    assert_error(as_operator.post(url), 409, "invalid_state")  # not finished yet
    assert drive(dry["id"]).status == Run.Status.SUCCEEDED
    assert_error(as_viewer.post(url), 403, "permission_denied")

    response = as_operator.post(url)

    assert response.status_code == 201, response.json()
    real = response.json()
    assert (real["dry_run"], real["promoted_from"]) == (False, dry["id"])
    assert real["input"] == dry["input"] and real["principal"] == "olivia"
    assert as_operator.get(f"/api/v1/runs/{dry['id']}/").json()["promoted_to"] == real["id"]
    assert_error(as_operator.post(url), 409, "already_promoted")
    assert_error(as_operator.post(f"/api/v1/runs/{real['id']}/promote/"), 409, "invalid_state")
    assert refund_posts(sandbox) == []  # nothing was refunded by the dry run
    assert drive(real["id"]).status == Run.Status.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1
