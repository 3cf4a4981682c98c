"""Tool calls over the API: the list of calls (unknown outcomes waiting for a person)."""

from __future__ import annotations

import pytest

from runs.models import ToolCall
from tests.api.conftest import assert_error

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]


def test_unknown_outcomes_are_listed(as_operator, attention_run, waiting_run):
    response = as_operator.get("/api/v1/tool-calls/", {"status": "unknown"})

    assert response.status_code == 200
    (item,) = response.json()["results"]
    call = ToolCall.objects.get(run=attention_run)
    assert item["id"] == call.id
    assert (item["status"], item["tool_name"], item["effect"]) == ("unknown", "api_send", "unsafe")
    assert item["idempotency_key"] == f"{attention_run.id}:{item['step_seq']}"
    assert item["receipt"] is None


def test_list_masks_sensitive_arguments_and_filters_by_run(as_operator, waiting_run):
    response = as_operator.get("/api/v1/tool-calls/", {"run": str(waiting_run.id)})

    (item,) = response.json()["results"]
    assert item["arguments"] == {"amount_cents": 500, "card": "***"}
    assert "4242-4242-SECRET" not in response.content.decode()


def test_list_query_count_is_flat(
    as_operator, waiting_run, attention_run, django_assert_num_queries
):
    as_operator.get("/api/v1/tool-calls/")
    # token, user permissions, group permissions, the page (with step and receipt joined),
    # then for masking (runs.masking) the page's runs and their declared tools' receipts
    with django_assert_num_queries(6):
        assert len(as_operator.get("/api/v1/tool-calls/").json()["results"]) == 2


def test_list_bad_filters(as_operator):
    for params, field in [({"status": "nope"}, "status"), ({"run": "not-a-uuid"}, "run")]:
        data = assert_error(as_operator.get("/api/v1/tool-calls/", params), 400, "validation_error")
        assert field in data["fields"]


def test_list_needs_view_permission(as_approver, django_user_model):
    from tests.api.conftest import client_for

    nobody = django_user_model.objects.create_user("nobody")
    assert_error(client_for(nobody).get("/api/v1/tool-calls/"), 403, "permission_denied")
    assert as_approver.get("/api/v1/tool-calls/").status_code == 200


# --- resolution (issue 3's toolcall_resolve) -----------------------------------------------


def _url(call: ToolCall) -> str:
    return f"/api/v1/tool-calls/{call.id}/resolution/"


def test_resolve_as_happened(as_operator, attention_run):
    from runs.models import Run, RunEvent

    call = ToolCall.objects.get(run=attention_run)

    response = as_operator.post(
        _url(call), {"outcome": "happened", "external_ref": "msg_1", "result": {"id": 1}}
    )

    assert response.status_code == 200, response.json()
    data = response.json()
    assert data["status"] == "succeeded"
    assert data["receipt"]["source"] == "operator"
    assert data["receipt"]["external_ref"] == "msg_1"
    assert Run.objects.get(id=attention_run.id).status == Run.Status.QUEUED
    event = RunEvent.objects.get(run=attention_run, type="tool.resolved")
    assert (event.actor, event.channel) == ("token:token-olivia", "api")


def test_dispatching_an_unsafe_call_again_needs_confirmation(as_operator, attention_run):
    call = ToolCall.objects.get(run=attention_run)

    response = as_operator.post(_url(call), {"outcome": "dispatch_again"})

    assert_error(response, 400, "unsafe_dispatch_unconfirmed")
    assert ToolCall.objects.get(id=call.id).status == ToolCall.Status.UNKNOWN
    confirmed = as_operator.post(_url(call), {"outcome": "dispatch_again", "confirm_risk": True})
    assert confirmed.status_code == 200


def test_resolve_in_the_wrong_state(as_operator, attention_run, waiting_run):
    call = ToolCall.objects.get(run=attention_run)
    assert_error(as_operator.post(_url(call), {"outcome": "reconcile"}), 409, "invalid_state")
    as_operator.post(_url(call), {"outcome": "not_happened", "attestation": "checked"})
    assert_error(as_operator.post(_url(call), {"outcome": "happened"}), 409, "invalid_state")
    other = ToolCall.objects.get(run=waiting_run)
    assert_error(as_operator.post(_url(other), {"outcome": "happened"}), 409, "invalid_state")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "outcome"),
        ({"outcome": "maybe"}, "outcome"),
        ({"outcome": "happened", "external_ref": "x" * 201}, "external_ref"),
        ({"outcome": "happened", "confirm_risk": "perhaps"}, "confirm_risk"),
    ],
)
def test_resolve_bad_input(as_operator, attention_run, body, field):
    call = ToolCall.objects.get(run=attention_run)
    data = assert_error(as_operator.post(_url(call), body), 400, "validation_error")
    assert field in data["fields"]
    assert ToolCall.objects.get(id=call.id).status == ToolCall.Status.UNKNOWN


def test_resolve_needs_permission_and_an_existing_call(as_viewer, as_operator, attention_run):
    call = ToolCall.objects.get(run=attention_run)
    assert_error(as_viewer.post(_url(call), {"outcome": "happened"}), 403, "permission_denied")
    response = as_operator.post("/api/v1/tool-calls/999999/resolution/", {"outcome": "happened"})
    assert_error(response, 404, "not_found")
