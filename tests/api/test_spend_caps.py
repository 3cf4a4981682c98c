"""Spend caps through the API and the console (issue 26 item 3, docs/agents.md "Spend caps"):
operators set caps, top scopes up and settle cut-off requests (audited), viewers read what
each scope has left, bad input is a clear 4xx."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.test import Client

from runs.models import AuditEntry, SpendCap, SpendCounter
from tests.api.conftest import assert_error

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

URL = "/api/v1/spend-caps/"


def test_an_operator_sets_a_cap_a_viewer_reads_what_is_left_and_a_top_up_is_audited(
    as_operator, as_viewer, operator
):
    answer = as_operator.post(
        URL,
        {"scope": "principal_day", "subject": "olivia", "max_cost": "25.00",
         "max_tokens": 1000, "reason": "team budget"},
        format="json",
    )  # fmt: skip
    assert answer.status_code == 200, answer.content
    (row,) = answer.json()
    assert row["subject"] == "olivia" and row["max_cost"] == "25.000000"
    assert row["cost_left"] == "25.000000" and row["tokens_left"] == 1000
    cap = SpendCap.objects.get()
    assert cap.subject == str(operator.pk) and cap.set_by.startswith("token:")
    assert AuditEntry.objects.get(action="spend.cap_set").after["max_tokens"] == 1000

    listed = as_viewer.get(URL).json()
    assert [(r["scope"], r["subject"]) for r in listed] == [("principal_day", "olivia")]

    topped = as_operator.post(
        URL + "top-up/",
        {"scope": "principal_day", "subject": "olivia", "add_cost": "5", "reason": "batch"},
        format="json",
    )
    assert topped.status_code == 200, topped.content
    assert topped.json()["scope"]["max_cost"] == "30.000000"
    assert topped.json()["resumed"] == 0
    assert SpendCounter.objects.get().cost_added == Decimal("5")
    assert AuditEntry.objects.filter(action="spend.topped_up").count() == 1

    assert (
        as_operator.post(
            URL + "remove/", {"scope": "principal_day", "subject": "olivia"}, format="json"
        ).status_code
        == 204
    )
    assert not SpendCap.objects.exists()
    assert_error(
        as_operator.post(URL + "remove/", {"scope": "principal_day", "subject": "olivia"},
                         format="json"),
        404,
        "not_found",
    )  # fmt: skip


def test_a_viewer_may_not_set_a_cap_or_top_up(as_viewer):
    body = {"scope": "global_day", "max_cost": "1"}
    assert_error(as_viewer.post(URL, body, format="json"), 403, "permission_denied")
    assert_error(
        as_viewer.post(URL + "top-up/", {"scope": "global_day", "add_cost": "1"}, format="json"),
        403,
        "permission_denied",
    )
    assert not SpendCap.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        {"scope": "eternity", "max_cost": "1"},
        {"scope": "global_day", "max_cost": "-1"},
        {"scope": "global_day", "max_tokens": "7"},  # a string is not a number
    ],
)
def test_a_cap_that_cannot_apply_is_a_validation_error(as_operator, body):
    assert_error(as_operator.post(URL, body, format="json"), 400, "validation_error")
    assert not SpendCap.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        {"scope": "agent", "subject": "no_such_agent", "max_cost": "1"},
        {"scope": "principal", "subject": "nobody", "max_cost": "1"},
    ],
)
def test_a_cap_on_an_agent_or_user_that_does_not_exist_is_not_found(as_operator, body):
    answer = assert_error(as_operator.post(URL, body, format="json"), 404, "not_found")
    assert "no " in answer["detail"]
    assert not SpendCap.objects.exists()


def test_topping_up_a_scope_without_a_cap_is_not_found_and_a_full_one_is_refused(as_operator):
    assert_error(
        as_operator.post(URL + "top-up/", {"scope": "global_day", "add_cost": "1"}, format="json"),
        404,
        "not_found",
    )
    as_operator.post(URL, {"scope": "global_day", "max_cost": "1"}, format="json")
    counter = SpendCounter.objects.create(scope="global_day", period=_today(), cost_used=5)
    assert_error(
        as_operator.post(URL + "top-up/", {"scope": "global_day", "add_cost": "1"}, format="json"),
        409,
        "budget_exhausted",
    )
    counter.refresh_from_db()
    assert counter.cost_added == 0  # refused: nothing changed


def test_settling_a_reservation_that_is_not_cut_off_is_refused(as_operator):
    assert_error(
        as_operator.post(
            "/api/v1/spend-reservations/999/settle/", {"cost": "1", "tokens": 5}, format="json"
        ),
        404,
        "not_found",
    )
    assert as_operator.get("/api/v1/spend-reservations/").json() == []


def _today() -> str:
    from runs import spend

    return spend.today()


def test_the_console_page_sets_a_cap_for_an_operator_and_refuses_bad_input(operator, viewer):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(operator)
    page = browser.get("/spend/")
    assert page.status_code == 200 and b"Set a cap" in page.content
    token = page.cookies["csrftoken"].value
    assert browser.post("/spend/", {"scope": "global_day", "max_cost": "5"}).status_code == 403
    bad = browser.post(
        "/spend/",
        {"action": "set", "scope": "agent", "subject": "no_such_agent", "max_cost": "1",
         "csrfmiddlewaretoken": token},
    )  # fmt: skip
    assert bad.status_code == 400 and b"no agent named" in bad.content
    done = browser.post(
        "/spend/",
        {"action": "set", "scope": "global_day", "max_cost": "5", "csrfmiddlewaretoken": token},
    )
    assert done.status_code == 302
    assert SpendCap.objects.get().max_cost == Decimal("5")
    assert AuditEntry.objects.get(action="spend.cap_set").actor == "user:olivia"
    topped = browser.post(
        "/spend/",
        {"action": "top_up", "scope": "global_day", "add_cost": "2", "csrfmiddlewaretoken": token},
    )
    assert topped.status_code == 302
    assert SpendCounter.objects.get().cost_added == Decimal("2")

    reader = Client()
    reader.force_login(viewer)
    shown = reader.get("/spend/")
    assert shown.status_code == 200 and b"all time" not in shown.content
    assert b"7.000000" in shown.content  # the cap plus today's top-up
    assert b"Set a cap" not in shown.content
    assert (
        reader.post(
            "/spend/", {"action": "set", "scope": "global_day", "max_cost": "1"}
        ).status_code
        == 403
    )
