"""The runs list page at ``/``."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from runs.models import Run
from runs.services import run_create

# `roles`: the role groups exist even after a transactional test flushed them
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


def _run(actor, *, goal: str, status: str = Run.Status.QUEUED, reason: str = "") -> Run:
    run = run_create(
        agent_name="refund",
        goal=goal,
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=actor,
    )
    Run.objects.filter(id=run.id).update(status=status, reason_code=reason)
    return Run.objects.get(id=run.id)


def _short(run: Run) -> str:
    return str(run.id)[:8]


def test_anonymous_is_sent_to_sign_in(client):
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"] == "/accounts/login/?next=/"


def test_sign_in_page_signs_in(client, viewer):
    page = client.get("/accounts/login/?next=/")
    assert page.status_code == 200
    assert b'name="username"' in page.content and b'name="password"' in page.content

    response = client.post(
        "/accounts/login/", {"username": "victor", "password": "pw-victor", "next": "/"}
    )
    assert response.status_code == 302 and response["Location"] == "/"

    wrong = client.post("/accounts/login/", {"username": "victor", "password": "nope"})
    assert wrong.status_code == 200
    assert b"do not match" in wrong.content


def test_a_user_without_a_role_is_forbidden(client):
    nobody = get_user_model().objects.create_user(username="nobody", password="pw")
    client.force_login(nobody)
    assert client.get("/").status_code == 403


def test_list_shows_runs_with_their_status_and_counts(client, viewer, system_actor):
    done = _run(system_actor, goal="Refund a late fee", status=Run.Status.SUCCEEDED)
    stuck = _run(
        system_actor,
        goal="Refund a lost parcel",
        status=Run.Status.NEEDS_ATTENTION,
        reason=Run.Reason.UNKNOWN_OUTCOME,
    )
    client.force_login(viewer)

    response = client.get("/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" in html and 'hx-headers=\'{"X-CSRFToken": "' in html
    assert _short(done) in html and _short(stuck) in html
    assert "Refund a late fee" in html and "Refund a lost parcel" in html
    assert '<span class="badge badge-succeeded">succeeded</span></td>' in html
    assert '<span class="badge badge-needs_attention">needs_attention</span></td>' in html
    assert "<code>unknown_outcome</code>" in html
    assert 'refund <span class="muted">v1</span>' in html
    assert "0 / 100" in html  # steps used / max
    counts = response.context["status_counts"]
    assert {c["status"]: c["count"] for c in counts if c["count"]} == {
        "succeeded": 1,
        "needs_attention": 1,
    }
    assert response.context["total"] == 2


def test_htmx_refresh_gets_only_the_table(client, viewer, system_actor):
    run = _run(system_actor, goal="Refund a late fee")
    client.force_login(viewer)

    response = client.get("/", headers={"HX-Request": "true"})

    html = response.content.decode()
    assert html.lstrip().startswith('<section id="runs"')
    assert "<html" not in html and "<body" not in html and "topbar" not in html
    assert _short(run) in html
    # it keeps polling itself, with the same filter
    assert 'hx-get="/" hx-trigger="every 3s" hx-swap="outerHTML"' in html


def test_filter_by_status(client, viewer, system_actor):
    done = _run(system_actor, goal="done", status=Run.Status.SUCCEEDED)
    waiting = _run(system_actor, goal="waiting", status=Run.Status.WAITING_APPROVAL)
    client.force_login(viewer)

    html = client.get("/?status=waiting_approval").content.decode()
    assert _short(waiting) in html and _short(done) not in html
    assert 'hx-get="/?status=waiting_approval"' in html

    partial = client.get("/?status=succeeded", headers={"HX-Request": "true"}).content.decode()
    assert _short(done) in partial and _short(waiting) not in partial

    empty = client.get("/?status=failed").content.decode()
    assert "No runs are failed." in empty

    # an unknown status filters nothing out
    unknown = client.get("/?status=bogus").content.decode()
    assert _short(done) in unknown and _short(waiting) in unknown


def test_run_goals_are_escaped(client, viewer, system_actor):
    _run(system_actor, goal="<script>alert(1)</script>")
    client.force_login(viewer)
    html = client.get("/").content.decode()
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


@pytest.mark.parametrize("runs", [1, 40])
def test_query_count_does_not_grow_with_the_number_of_runs(
    client, viewer, system_actor, django_assert_max_num_queries, runs
):
    statuses = list(Run.Status.values)
    for i in range(runs):
        _run(system_actor, goal=f"run {i}", status=statuses[i % len(statuses)])
    client.force_login(viewer)

    # session, user, the permission check (2), status counts, the list
    with django_assert_max_num_queries(6):
        page = client.get("/")
    with django_assert_max_num_queries(6):
        partial = client.get("/", headers={"HX-Request": "true"})
    assert page.status_code == partial.status_code == 200
    assert len(page.context["runs"]) == runs
