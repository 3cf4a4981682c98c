"""The events page at ``/events/``: every run's events, searchable by type (or a prefix),
actor, run and time, newest first, paged; every filter in the URL; payloads never shown."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from runs.actors import Actor
from runs.models import RunEvent
from runs.services import run_create, run_terminate

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

EVENTS = "/events/"


def _shown(client, query: str = "") -> list[tuple[str, str]]:
    html = client.get(EVENTS + query).content.decode()
    return re.findall(
        r"<td><code>([a-z_.]+)</code> <span class=\"muted small\">#\d+</span></td>\s*<td><a class=\"run-link\" href=\"/runs/([0-9a-f-]+)/\"",
        html,
    )


@pytest.fixture
def two_runs(system_actor, operator):
    first = run_create(
        agent_name="refund",
        goal="first",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=system_actor,
    )
    second = run_create(
        agent_name="refund",
        goal="second",
        input={"order_id": "ord_1002", "amount_cents": 500},
        actor=system_actor,
    )
    run_terminate(run_id=second.id, actor=Actor.for_user(operator, "web"), reason="not needed")
    return first, second


def test_the_page_lists_every_runs_events_newest_first(client, viewer, two_runs):
    first, second = two_runs
    client.force_login(viewer)

    shown = _shown(client)

    assert reverse("runs:event_list") == EVENTS
    assert shown[0] == ("run.terminated", str(second.id))
    assert ("run.created", str(first.id)) in shown
    assert len(shown) == RunEvent.objects.count()


def test_search_by_type_prefix_actor_and_run(client, viewer, operator, two_runs):
    first, second = two_runs
    client.force_login(viewer)

    assert _shown(client, "?type=run.terminated") == [("run.terminated", str(second.id))]
    assert {t for t, _ in _shown(client, "?type=run.")} >= {"run.created", "run.terminated"}
    by_operator = _shown(client, f"?actor=user:{operator.get_username()}")
    assert by_operator and all(run == str(second.id) for _, run in by_operator)
    assert {run for _, run in _shown(client, f"?run={str(first.id)[:8]}")} == {str(first.id)}
    assert _shown(client, "?run=not-an-id") == []  # nothing, not everything
    html = client.get(EVENTS + "?type=run.terminated&actor=user:").content.decode()
    assert 'value="run.terminated"' in html and 'value="user:"' in html


def test_pages_go_back_in_time_and_keep_the_filters(client, viewer, system_actor, monkeypatch):
    from runs import selectors

    monkeypatch.setattr(selectors, "EVENT_PAGE_SIZE", 2)
    for n in range(3):
        run_create(
            agent_name="refund",
            goal=f"run {n}",
            input={"order_id": f"ord_10{n}", "amount_cents": 5},
            actor=system_actor,
        )
    client.force_login(viewer)

    page_1 = client.get(EVENTS + "?type=run.created")
    older = re.search(r'href="\?([^"]+)" rel="next"', page_1.content.decode()).group(1)
    page_2 = client.get(EVENTS + "?" + older.replace("&amp;", "&"))

    assert "type=run.created" in older
    assert [len(page_1.context["events"]), len(page_2.context["events"])] == [2, 1]
    assert 'rel="next"' not in page_2.content.decode()
    ids_1 = {e.id for e in page_1.context["events"]}
    ids_2 = {e.id for e in page_2.context["events"]}
    assert not ids_1 & ids_2
    assert max(ids_2) < min(ids_1)


def test_who_may_see_it(client, approver, viewer):
    assert client.get(EVENTS).status_code == 302  # signed out: to the sign-in page
    client.force_login(approver)  # approvers read runs and calls, not the event record
    assert client.get(EVENTS).status_code == 403
    client.force_login(viewer)
    page = client.get(EVENTS).content.decode()
    assert 'href="/events/"' in page  # and the navigation offers it
