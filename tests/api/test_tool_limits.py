"""Tool limits through the API and the console (issue 26, docs/agents.md "Limits"): operators
set and remove them (audited), viewers read them, bad input is a clear 400."""

from __future__ import annotations

import pytest
from django.test import Client

from runs.models import AuditEntry, ToolLimit
from tests.api.conftest import assert_error

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

URL = "/api/v1/tool-limits/"


def test_an_operator_sets_a_limit_and_removes_it_audited(as_operator, as_viewer):
    answer = as_operator.post(
        URL,
        {"tool_name": "refund_payment", "max_in_flight": 2, "rate": 10, "per_seconds": 60,
         "burst": 3, "key_argument": "order_id", "reason": "the PSP asked"},
        format="json",
    )  # fmt: skip
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["set_by_operator"] is True and body["set_by"].startswith("token:")
    assert body["effective"] == {"max_in_flight": 2, "rate": 10.0, "per_seconds": 60.0,
                                 "burst": 3, "key_argument": "order_id"}  # fmt: skip
    entry = AuditEntry.objects.get(action="tool.limit_set")
    assert entry.object_id == "refund_payment" and entry.after["max_in_flight"] == 2

    listed = as_viewer.get(URL).json()
    assert [row["tool_name"] for row in listed] == ["refund_payment"]
    assert listed[0]["in_flight"] == 0 and listed[0]["waiting"] == 0

    removed = as_operator.post(URL + "remove/", {"tool_name": "refund_payment"}, format="json")
    assert removed.status_code == 200, removed.content
    assert not ToolLimit.objects.exists()
    assert AuditEntry.objects.filter(action="tool.limit_removed").count() == 1
    assert_error(
        as_operator.post(URL + "remove/", {"tool_name": "refund_payment"}, format="json"),
        404,
        "not_found",
    )


def test_a_viewer_may_not_set_a_limit(as_viewer):
    assert_error(
        as_viewer.post(URL, {"tool_name": "refund_payment", "max_in_flight": 1}, format="json"),
        403,
        "permission_denied",
    )
    assert not ToolLimit.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        {"tool_name": "refund_payment", "max_in_flight": "2"},  # a string is not a number
        {"tool_name": "refund_payment", "max_in_flight": 1, "reason": 0},
        {"tool_name": "refund_payment", "max_in_flight": 0},
        {"tool_name": "refund_payment", "rate": -1},
        {"tool_name": "refund_payment", "rate": 1, "per_seconds": 7},
    ],
)
def test_a_limit_that_cannot_apply_is_a_validation_error(as_operator, body):
    assert_error(as_operator.post(URL, body, format="json"), 400, "validation_error")
    assert not ToolLimit.objects.exists()


def test_the_console_page_sets_a_limit_for_an_operator_and_refuses_bad_input(operator, viewer):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(operator)
    page = browser.get("/limits/")
    assert page.status_code == 200 and b"Set a limit" in page.content
    token = page.cookies["csrftoken"].value
    bad = browser.post(
        "/limits/",
        {"tool_name": "no_such_tool", "max_in_flight": "1", "per_seconds": "1",
         "csrfmiddlewaretoken": token},
    )  # fmt: skip
    assert bad.status_code == 400 and b"no tool named" in bad.content
    assert not ToolLimit.objects.exists()
    done = browser.post(
        "/limits/",
        {"tool_name": "refund_payment", "max_in_flight": "2", "per_seconds": "1",
         "csrfmiddlewaretoken": token},
    )  # fmt: skip
    assert done.status_code == 302
    assert ToolLimit.objects.get().max_in_flight == 2
    assert AuditEntry.objects.get(action="tool.limit_set").actor == "user:olivia"

    reader = Client()
    reader.force_login(viewer)
    shown = reader.get("/limits/")
    assert shown.status_code == 200 and b"refund_payment" in shown.content
    assert b"Set a limit" not in shown.content
    assert reader.post("/limits/", {"tool_name": "refund_payment", "max_in_flight": "1",
                                    "per_seconds": "1"}).status_code == 403  # fmt: skip


def test_an_operators_limit_with_nothing_set_lifts_the_declared_one(as_operator):
    answer = as_operator.post(URL, {"tool_name": "refund_payment"}, format="json")
    assert answer.status_code == 200, answer.content
    assert answer.json()["effective"]["max_in_flight"] is None
    assert answer.json()["effective"]["rate"] is None


def test_a_limit_on_a_tool_that_does_not_exist_is_not_found(as_operator):
    body = {"tool_name": "no_such_tool", "max_in_flight": 1}
    assert_error(as_operator.post(URL, body, format="json"), 404, "not_found")
    assert not ToolLimit.objects.exists()
