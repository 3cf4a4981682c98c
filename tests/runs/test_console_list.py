"""The runs list at ``/runs/``: filters, sort, keyset pages, live refresh, starting a run and
bulk actions (docs/operations.md, "Console and alerts")."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from runs.models import Run, RunEvent
from runs.services import run_create

# `roles`: the role groups exist even after a transactional test flushed them
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

LIST = "/runs/"
START = "/runs/start/"
BULK = "/runs/bulk/"
REFUND_INPUT = {"order_id": "ord_1001", "amount_cents": 500}


def _run(
    actor,
    *,
    goal: str,
    status: str = Run.Status.QUEUED,
    reason: str = "",
    agent: str = "refund",
    age_minutes: int = 0,
) -> Run:
    inputs = {
        "refund": REFUND_INPUT,
        "followup": {"order_id": "ord_1", "message": "hi"},
    }
    run = run_create(agent_name=agent, goal=goal, input=inputs[agent], actor=actor)
    moment = timezone.now() - timedelta(minutes=age_minutes)
    Run.objects.filter(id=run.id).update(
        status=status, reason_code=reason, created_at=moment, updated_at=moment
    )
    return Run.objects.get(id=run.id)


def _short(run: Run) -> str:
    return str(run.id)[:8]


def _bulk_results(html: str) -> dict[str, tuple[bool, str]]:
    """run id -> (done?, message) as the bulk report shows them."""
    rows = re.findall(
        r'<li class="(ok|refused)" data-run="([^"]+)">.*?<span class="result-message">(.*?)</span>',
        html,
    )
    return {run_id: (kind == "ok", message) for kind, run_id, message in rows}


@pytest.fixture
def admin_user(django_user_model):
    user = django_user_model.objects.create_user(username="ada", password="pw-ada")
    user.groups.add(Group.objects.get(name="admin"))
    return user


@pytest.fixture
def superuser(django_user_model):
    return django_user_model.objects.create_superuser(username="root", password="pw-root")


# --- the page --------------------------------------------------------------------------------


def test_the_list_moved_to_runs_and_the_name_points_there():
    assert reverse("runs:list") == LIST
    assert reverse("runs:dashboard") == "/"


def test_list_shows_runs_with_status_text_and_counts(client, viewer, system_actor):
    done = _run(system_actor, goal="Refund a late fee", status=Run.Status.SUCCEEDED)
    stuck = _run(
        system_actor,
        goal="Refund a lost parcel",
        status=Run.Status.NEEDS_ATTENTION,
        reason=Run.Reason.UNKNOWN_OUTCOME,
    )
    client.force_login(viewer)

    response = client.get(LIST)

    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" in html and 'hx-headers=\'{"X-CSRFToken": "' in html
    assert _short(done) in html and _short(stuck) in html
    assert f'href="{reverse("runs:detail", args=[done.id])}"' in html
    assert "Refund a late fee" in html and "Refund a lost parcel" in html
    # the status is the word, in a coloured badge
    assert '<span class="badge badge-succeeded">succeeded</span>' in html
    assert '<span class="badge badge-needs_attention">needs_attention</span>' in html
    assert '<code class="reason">unknown_outcome</code>' in html
    assert 'refund <span class="muted">v1</span>' in html
    assert "0 / 100" in html  # steps used / max
    counts = {c["status"]: c["count"] for c in response.context["status_counts"] if c["count"]}
    assert counts == {"succeeded": 1, "needs_attention": 1}
    assert response.context["total"] == 2
    # times are relative, with the absolute time in the title
    assert re.search(r'<time datetime="[^"]+" title="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [^"]+">', html)


def test_anonymous_is_sent_to_sign_in(client):
    for url in (LIST, START):
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"] == f"/accounts/login/?next={url}"
    response = client.post(BULK, {"action": "retry"})
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


def test_a_user_without_a_role_is_forbidden(client):
    nobody = get_user_model().objects.create_user(username="nobody", password="pw")
    client.force_login(nobody)
    assert client.get(LIST).status_code == 403


def test_htmx_refresh_gets_only_the_table_and_keeps_the_filters(client, viewer, system_actor):
    run = _run(system_actor, goal="Refund a late fee", status=Run.Status.SUCCEEDED)
    client.force_login(viewer)

    response = client.get(LIST + "?status=succeeded&q=late", headers={"HX-Request": "true"})

    html = response.content.decode()
    assert html.lstrip().startswith('<section id="runs-table"')
    assert "<html" not in html and "topbar" not in html
    assert _short(run) in html
    assert 'hx-get="/runs/?status=succeeded&amp;q=late"' in html
    assert 'hx-trigger="every 5s, runs-changed from:body"' in html


def test_htmx_refresh_of_the_counters_gets_only_the_counters(client, viewer, system_actor):
    _run(system_actor, goal="a", status=Run.Status.SUCCEEDED)
    client.force_login(viewer)

    response = client.get(
        LIST, headers={"HX-Request": "true", "HX-Target": "run-counts"}
    ).content.decode()

    assert response.lstrip().startswith('<nav id="run-counts"')
    assert "runs-table" not in response
    assert 'hx-trigger="every 15s, runs-changed from:body"' in response


def test_goals_are_escaped(client, viewer, system_actor):
    _run(system_actor, goal="<script>alert(1)</script>")
    client.force_login(viewer)
    html = client.get(LIST).content.decode()
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_empty_states_say_what_to_do(client, operator, viewer, system_actor):
    client.force_login(operator)
    html = client.get(LIST).content.decode()
    assert "No runs yet." in html and f'href="{START}"' in html

    _run(system_actor, goal="something")
    html = client.get(LIST + "?q=nothing-matches-this").content.decode()
    assert "No runs match these filters." in html

    client.force_login(viewer)
    html = client.get(LIST + "?q=nothing-matches-this").content.decode()
    assert f'href="{START}"' not in html  # a viewer is not offered what they may not do


# --- filters, sort, pages ------------------------------------------------------------------


def test_filter_by_status_agent_and_text(client, viewer, system_actor):
    done = _run(system_actor, goal="refund the late fee", status=Run.Status.SUCCEEDED)
    waiting = _run(system_actor, goal="refund the parcel", status=Run.Status.WAITING_APPROVAL)
    other = _run(system_actor, goal="say sorry", agent="followup")
    client.force_login(viewer)

    def shown(query: str) -> set[str]:
        runs = client.get(LIST + query).context["runs"]
        return {_short(r) for r in runs}

    assert shown("?status=waiting_approval") == {_short(waiting)}
    assert shown("?agent=followup") == {_short(other)}
    assert shown("?q=PARCEL") == {_short(waiting)}  # case-insensitive goal search
    assert shown("?q=refund&status=succeeded") == {_short(done)}
    # an id prefix finds the run, with or without the dashes
    assert _short(other) in shown("?q=" + str(other.id)[:6])
    assert shown("?q=" + str(done.id)[:13]) == {_short(done)}
    assert shown("?q=" + done.id.hex) == {_short(done)}
    # a filter that means nothing shows everything rather than an error
    assert shown("?status=bogus&sort=sideways&after=%%%") == {
        _short(done),
        _short(waiting),
        _short(other),
    }


def test_search_by_reason_tool_principal_key_time_and_order_id(
    client, viewer, operator, system_actor
):
    from runs.actors import Actor

    stuck = _run(
        system_actor,
        goal="stuck",
        status=Run.Status.NEEDS_ATTENTION,
        reason=Run.Reason.UNKNOWN_OUTCOME,
        age_minutes=90,
    )
    mine = run_create(
        agent_name="refund",
        goal="mine",
        input={"order_id": "ord_1004", "amount_cents": 250000},
        actor=Actor.for_user(operator, "web"),
    )
    followup = _run(system_actor, goal="follow up", agent="followup")
    step = stuck.steps.create(seq=1, kind="tool_call", status="pending", input={}, incarnation=1)
    stuck.tool_calls.create(
        step=step,
        tool_name="refund_payment",
        tool_version="v",
        effect="idempotent",
        arguments={},
        arguments_digest="d",
        idempotency_key=f"{stuck.id}:1",
        status="unknown",
    )
    client.force_login(viewer)

    def shown(query: str) -> set[str]:
        runs = client.get(LIST + query).context["runs"]
        return {_short(r) for r in runs}

    assert shown("?reason=unknown_outcome") == {_short(stuck)}
    assert shown("?tool=refund_payment") == {_short(stuck)}
    assert shown(f"?principal={operator.get_username()}") == {_short(mine)}
    assert shown(f"?key={stuck.id}:1") == {_short(stuck)}
    # the agent declares order_id searchable: the search box finds the run by it
    assert shown("?q=ord_1004") == {_short(mine)}
    assert shown("?q=ord_1") == {_short(followup)}  # a value, not a part of one
    an_hour_ago = (timezone.localtime() - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    assert shown(f"?since={an_hour_ago}") == {_short(mine), _short(followup)}
    assert shown(f"?until={an_hour_ago}") == {_short(stuck)}
    # the filters stay in the page's links and the live refresh
    html = client.get(f"{LIST}?reason=unknown_outcome&tool=refund_payment").content.decode()
    assert "reason=unknown_outcome&amp;tool=refund_payment" in html
    assert '<details class="more-filters" open>' in html


def test_sort_orders(client, viewer, system_actor):
    old = _run(system_actor, goal="old", status=Run.Status.SUCCEEDED, age_minutes=30)
    mid = _run(system_actor, goal="mid", status=Run.Status.FAILED, age_minutes=20)
    new = _run(system_actor, goal="new", status=Run.Status.QUEUED, age_minutes=10)
    Run.objects.filter(id=old.id).update(updated_at=timezone.now())
    client.force_login(viewer)

    def order(sort: str) -> list[str]:
        return [r.goal for r in client.get(f"{LIST}?sort={sort}").context["runs"]]

    assert order("-created") == ["new", "mid", "old"]
    assert order("created") == ["old", "mid", "new"]
    assert order("-updated") == ["old", "new", "mid"]
    assert order("updated") == ["mid", "new", "old"]
    assert order("status") == ["mid", "new", "old"]  # failed, queued, succeeded
    assert [new.goal, mid.goal, old.goal] == order("")


@pytest.mark.parametrize("sort", ["-created", "created", "-updated", "updated", "status"])
def test_keyset_pages_walk_every_run_once_forwards_and_backwards(
    client, viewer, system_actor, monkeypatch, sort
):
    from runs import selectors

    monkeypatch.setattr(selectors, "RUN_PAGE_SIZE", 4)
    statuses = [Run.Status.QUEUED, Run.Status.SUCCEEDED, Run.Status.FAILED]
    # ties in every sort key (same minute, same status): the id breaks them
    for i in range(11):
        _run(system_actor, goal=f"run {i}", status=statuses[i % 3], age_minutes=i % 3)
    columns = [f"-{f}" if desc else f for f, desc in selectors.RUN_SORTS[sort]]
    expected = [str(i) for i in Run.objects.order_by(*columns, "-id").values_list("id", flat=True)]
    client.force_login(viewer)

    def page(query: str) -> tuple[list[str], str, str]:
        ctx = client.get(f"{LIST}?{query}").context
        return [str(r.id) for r in ctx["runs"]], ctx["next_query"], ctx["prev_query"]

    pages = []
    ids, next_query, prev_query = page(f"sort={sort}")
    assert prev_query == ""  # the first page has nothing before it
    pages.append(ids)
    while next_query:
        assert f"sort={sort}" in next_query  # the sort is kept from page to page
        ids, next_query, prev_query = page(next_query)
        pages.append(ids)
    assert [len(p) for p in pages] == [4, 4, 3]
    assert [i for p in pages for i in p] == expected  # every run once, in order

    # "Previous" walks back through the same pages
    back = [pages[-1]]
    while prev_query:
        ids, _, prev_query = page(prev_query)
        back.append(ids)
    assert back == pages[::-1]


def test_a_page_cursor_from_another_sort_or_a_bad_one_shows_the_first_page(
    client, viewer, system_actor
):
    _run(system_actor, goal="a")
    client.force_login(viewer)
    for cursor in ("not-base64!", "WzFd", "W10", "eyJhIjogMX0"):
        response = client.get(f"{LIST}?after={cursor}")
        assert response.status_code == 200
        assert len(response.context["runs"]) == 1


@pytest.mark.parametrize("runs", [2, 30])
def test_query_count_does_not_grow_with_the_number_of_runs(
    client, operator, system_actor, django_assert_num_queries, runs
):
    from runs.actors import Actor

    statuses = list(Run.Status.values)
    as_operator = Actor.for_user(operator, "web")  # runs with a principal, shown per row
    for i in range(runs):
        actor = as_operator if i % 2 else system_actor
        _run(actor, goal=f"run {i}", status=statuses[i % len(statuses)])
    client.force_login(operator)

    # session, user, permissions (user + group), the page of runs, the counts, remote agents;
    # on PostgreSQL the counts read the table's size estimate first (selectors.run_status_counts)
    estimate = 1 if connection.vendor == "postgresql" else 0
    with django_assert_num_queries(7 + estimate):
        page = client.get(LIST + "?status=&sort=-updated")
    # the periodic refresh: no aggregate at all, just the page of runs
    with django_assert_num_queries(5):
        partial = client.get(LIST, headers={"HX-Request": "true"})
    with django_assert_num_queries(5 + estimate):
        counts = client.get(LIST, headers={"HX-Request": "true", "HX-Target": "run-counts"})
    assert page.status_code == partial.status_code == counts.status_code == 200
    assert len(page.context["runs"]) == runs
    assert "as olivia" in page.content.decode()


# --- start a run ----------------------------------------------------------------------------


def test_start_form_lists_agents_and_their_schemas(client, operator):
    client.force_login(operator)
    response = client.get(START + "?agent=refund")
    assert response.status_code == 200
    html = response.content.decode()
    assert '<option value="refund" selected>refund</option>' in html
    assert "amount_cents" in html  # the input schema is shown
    assert 'name="csrfmiddlewaretoken"' in html


def test_starting_a_run_creates_it_as_the_operator(client, operator):
    client.force_login(operator)
    response = client.post(
        START,
        {
            "agent": "refund",
            "goal": "Refund order 1001",
            "input": json.dumps(REFUND_INPUT),
            "max_steps": "20",
        },
    )
    run = Run.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("runs:detail", args=[run.id])
    assert (run.agent_name, run.goal, run.input, run.max_steps) == (
        "refund",
        "Refund order 1001",
        REFUND_INPUT,
        20,
    )
    assert run.principal == operator
    created = RunEvent.objects.get(run=run, type="run.created")
    assert (created.actor, created.channel) == ("user:olivia", "web")


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"input": "{not json"}, "input", "This is not valid JSON"),
        ({"input": "[1, 2]"}, "input", "The input must be a JSON object"),
        ({"input": '{"order_id": "nope"}'}, "input", "does not match the agent&#x27;s schema"),
        ({"input": '{"order_id": "ord_1", "amount_cents": 0}'}, "input", "amount_cents"),
        ({"agent": "no-such-agent"}, "agent", "Select a valid choice"),
        ({"max_steps": "0"}, "max_steps", "greater than or equal to 1"),
        ({"input": ""}, "input", "This field is required"),
        # issue 18: the JSON rule, the same on both databases
        ({"input": '{"a": ' * 1000 + "1" + "}" * 1000}, "input", "nested more than 32"),
        # never cut to fit: an error naming the limit
        ({"goal": "g" * 2001}, "goal", "at most 2000 characters"),
        ({"input": '{"order_id": "ord_1\\u0000"}'}, "input", "NUL characters"),
    ],
)
def test_start_form_errors_are_shown_and_nothing_is_created(client, operator, data, field, message):
    client.force_login(operator)
    post = {"agent": "refund", "goal": "g", "input": json.dumps(REFUND_INPUT), **data}

    response = client.post(START, post)

    assert response.status_code == 400
    assert field in response.context["form"].errors
    assert message in response.content.decode()
    assert not Run.objects.exists()
    # what the operator typed is kept
    assert response.context["form"]["goal"].value() == post["goal"]


def test_start_refuses_a_user_without_start_permission(client, viewer, approver):
    for user in (viewer, approver):
        client.force_login(user)
        assert client.get(START).status_code == 403
        response = client.post(
            START, {"agent": "refund", "goal": "g", "input": json.dumps(REFUND_INPUT)}
        )
        assert response.status_code == 403
    assert not Run.objects.exists()


def test_start_is_offered_only_to_who_may_start(client, viewer, operator):
    client.force_login(viewer)
    assert f'href="{START}"' not in client.get(LIST).content.decode()
    client.force_login(operator)
    assert f'href="{START}"' in client.get(LIST).content.decode()


# --- bulk actions ---------------------------------------------------------------------------


def test_bulk_terminate_reports_each_run_and_names_the_operator(client, operator, system_actor):
    queued = _run(system_actor, goal="a")
    waiting = _run(system_actor, goal="b", status=Run.Status.WAITING_APPROVAL)
    finished = _run(system_actor, goal="c", status=Run.Status.SUCCEEDED)
    client.force_login(operator)

    response = client.post(
        BULK,
        {
            "action": "terminate",
            "reason": "duplicate orders",
            "run": [str(queued.id), str(waiting.id), str(finished.id)],
        },
        headers={"HX-Request": "true"},
    )

    assert response.status_code == 200
    assert response["HX-Trigger"] == "runs-changed"
    html = response.content.decode()
    assert "Terminate: 2 of 3 runs done, 1 refused." in html
    results = _bulk_results(html)
    assert results[str(queued.id)] == (True, "terminated")
    assert results[str(waiting.id)] == (True, "terminated")
    assert results[str(finished.id)] == (False, "run is already succeeded")
    for run in (queued, waiting):
        run.refresh_from_db()
        assert run.status == Run.Status.TERMINATED
        event = RunEvent.objects.get(run=run, type="run.terminated")
        assert (event.actor, event.channel) == ("user:olivia", "web")
        assert event.payload["reason"] == "duplicate orders"
    finished.refresh_from_db()
    assert finished.status == Run.Status.SUCCEEDED
    assert not RunEvent.objects.filter(run=finished, type__startswith="run.terminate").exists()


def test_bulk_without_javascript_redirects_back_with_messages(client, operator, system_actor):
    run = _run(system_actor, goal="a")
    client.force_login(operator)

    response = client.post(
        BULK,
        {
            "action": "terminate",
            "reason": "wrong customer",
            "run": [str(run.id)],
            "next": "/runs/?status=queued",
        },
        follow=True,
    )

    assert response.redirect_chain == [("/runs/?status=queued", 302)]
    html = response.content.decode()
    assert "Terminate: 1 of 1 runs done." in html
    assert f"{_short(run)}: terminated" in html
    run.refresh_from_db()
    assert run.status == Run.Status.TERMINATED


def test_bulk_next_must_stay_on_this_site(client, operator, system_actor):
    run = _run(system_actor, goal="a")
    client.force_login(operator)
    response = client.post(
        BULK,
        {
            "action": "terminate",
            "reason": "x",
            "run": [str(run.id)],
            "next": "https://evil.example/",
        },
    )
    assert response.status_code == 302 and response["Location"] == LIST


def test_bulk_retry_recovery_only_moves_dead_lettered_runs(client, operator, system_actor):
    dead = _run(
        system_actor,
        goal="dead",
        status=Run.Status.NEEDS_ATTENTION,
        reason=Run.Reason.RECOVERY_LIMIT,
    )
    unknown = _run(
        system_actor,
        goal="unknown",
        status=Run.Status.NEEDS_ATTENTION,
        reason=Run.Reason.UNKNOWN_OUTCOME,
    )
    client.force_login(operator)

    response = client.post(
        BULK,
        {"action": "retry", "run": [str(dead.id), str(unknown.id)]},
        headers={"HX-Request": "true"},
    )

    results = _bulk_results(response.content.decode())
    assert results == {
        str(dead.id): (True, "queued for another recovery"),
        str(unknown.id): (
            False,
            "only a run stopped at its recovery limit, for a missing state migration, a "
            "failing tool precondition or a model that is gone can be retried",
        ),
    }
    dead.refresh_from_db()
    unknown.refresh_from_db()
    assert dead.status == Run.Status.QUEUED
    assert unknown.status == Run.Status.NEEDS_ATTENTION
    event = RunEvent.objects.get(run=dead, type="run.recovery_retried")
    assert event.actor == "user:olivia"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"action": "terminate", "reason": ""}, "Say why these runs are terminated"),
        ({"action": "terminate", "reason": "   "}, "Say why these runs are terminated"),
        ({"action": "explode", "reason": "x"}, "Choose an action."),
        ({"action": "retry", "run": []}, "Select at least one run."),
        ({"action": "retry", "run": ["not-a-uuid"]}, "is not a run id"),
    ],
)
def test_bulk_bad_input_changes_nothing(client, operator, system_actor, data, message):
    run = _run(system_actor, goal="a")
    client.force_login(operator)
    post = {"run": [str(run.id)], **data}

    for headers in ({"HX-Request": "true"}, {}):
        response = client.post(BULK, post, headers=headers)
        assert response.status_code == 400
        assert message in response.content.decode()
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    assert RunEvent.objects.filter(run=run).count() == 1  # only run.created


def test_bulk_unknown_run_is_reported_not_a_500(client, operator):
    client.force_login(operator)
    missing = "00000000-0000-4000-8000-000000000000"
    response = client.post(
        BULK,
        {"action": "terminate", "reason": "x", "run": [missing]},
        headers={"HX-Request": "true"},
    )
    assert response.status_code == 200
    assert _bulk_results(response.content.decode()) == {missing: (False, "no such run")}


def test_bulk_is_too_many_above_the_limit(client, operator, system_actor):
    from runs.views.console import BULK_LIMIT

    client.force_login(operator)
    ids = [f"00000000-0000-4000-8000-{i:012d}" for i in range(BULK_LIMIT + 1)]
    response = client.post(BULK, {"action": "retry", "run": ids}, headers={"HX-Request": "true"})
    assert response.status_code == 400
    assert f"Select at most {BULK_LIMIT} runs at a time." in response.content.decode()


def test_bulk_rejects_get(client, operator):
    client.force_login(operator)
    assert client.get(BULK).status_code == 405


def test_bulk_needs_csrf(operator, system_actor):
    from django.test import Client

    run = _run(system_actor, goal="a")
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(operator)
    response = strict.post(BULK, {"action": "terminate", "reason": "x", "run": [str(run.id)]})
    assert response.status_code == 403
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED


# --- permissions matrix ---------------------------------------------------------------------

ROLES = ["anonymous", "viewer", "operator", "approver", "admin", "superuser"]
# what each role may do on these pages: view the list, start a run, bulk-act
ALLOWED = {
    "anonymous": (False, False, False),
    "viewer": (True, False, False),
    "operator": (True, True, True),
    "approver": (True, False, False),
    "admin": (True, True, True),
    "superuser": (True, True, True),
}


@pytest.fixture
def as_role(client, request):
    def _login(role: str):
        if role != "anonymous":
            fixture = {"admin": "admin_user"}.get(role, role)
            client.force_login(request.getfixturevalue(fixture))
        return client

    return _login


@pytest.mark.parametrize("role", ROLES)
def test_permissions_matrix(as_role, role, system_actor):
    may_view, may_start, may_bulk = ALLOWED[role]
    run = _run(system_actor, goal="target")
    client = as_role(role)

    view = client.get(LIST)
    start = client.post(
        START, {"agent": "refund", "goal": "new", "input": json.dumps(REFUND_INPUT)}
    )
    bulk = client.post(
        BULK,
        {"action": "terminate", "reason": "matrix", "run": [str(run.id)]},
        headers={"HX-Request": "true"},
    )

    if role == "anonymous":
        assert {view.status_code, start.status_code} == {302}
        # an htmx POST is sent to the sign-in page as a whole page
        assert bulk.status_code == 204 and bulk["HX-Redirect"].startswith("/accounts/login/")
    else:
        assert view.status_code == (200 if may_view else 403)
        assert start.status_code == (302 if may_start else 403)
        assert bulk.status_code == (200 if may_bulk else 403)
    assert Run.objects.filter(goal="new").exists() == may_start
    run.refresh_from_db()
    assert (run.status == Run.Status.TERMINATED) == may_bulk
    if may_bulk:
        event = RunEvent.objects.get(run=run, type="run.terminated")
        assert event.actor.startswith("user:") and event.channel == "web"
    if role in ("viewer", "approver"):
        assert "operator role" in bulk.content.decode()
        # and the page offers no bulk controls
        assert 'id="bulk-form"' not in view.content.decode()
    if may_bulk:
        assert 'id="bulk-form"' in view.content.decode()


def test_no_text_field_is_cut_by_the_browser(client, operator):
    # a maxlength attribute makes a browser cut pasted text without a word (issue 18)
    client.force_login(operator)

    page = client.get(START).content.decode()

    assert "maxlength" not in page


def test_past_the_exact_size_ended_runs_are_counted_once_a_minute_and_live_ones_always(
    system_actor, monkeypatch
):
    """Issue 24 (scale): counting a million ended runs on every page cost ~100 ms; past
    ``EXACT_COUNTS_UP_TO`` the ended counts come from a cache (refreshed every minute), the
    runs that may need someone are always counted exactly."""
    from django.core.cache.backends.locmem import LocMemCache

    from runs import selectors

    monkeypatch.setattr(selectors, "_runs_estimate", lambda: 10**6)  # as if the table were huge
    cache = LocMemCache("ended-run-counts-test", {})
    monkeypatch.setattr(selectors, "cache", cache)
    before = selectors.run_status_counts()  # counts the ended runs, keeps them a minute

    _run(system_actor, goal="done", status=Run.Status.SUCCEEDED)
    _run(system_actor, goal="parked", status=Run.Status.NEEDS_ATTENTION)
    after = selectors.run_status_counts()
    assert after["needs_attention"] == before["needs_attention"] + 1  # exact, always
    assert after["succeeded"] == before["succeeded"]  # as counted at most a minute ago

    cache.clear()  # the minute passed
    assert selectors.run_status_counts()["succeeded"] == before["succeeded"] + 1
