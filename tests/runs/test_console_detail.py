"""The run page (``runs:detail``) and its actions: what an operator sees and may do."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.urls import reverse
from django.utils import timezone

from runs import engine
from runs.models import Run, RunEvent, Step
from runs.registry import CallTool, Effect, Finish, LookupResult, Reconciliation
from runs.services import run_create, run_pause
from tests.conftest import drive
from tests.support import (
    CountingTool,
    ScriptedAgent,
    WorkerKilled,
    event_types,
    events,
    expire_lease,
    make_tool,
)

# `roles`: the role groups exist even after a transactional test flushed them
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


# --- agents ---------------------------------------------------------------------------------


@pytest.fixture
def reader(register):
    """Reads ``input["reads"]`` times (default 2), then finishes."""
    body = CountingTool()

    def decide(ctx):
        if len(ctx.steps) < ctx.input.get("reads", 2):
            return CallTool("console_read", {"n": len(ctx.steps) + 1, "card": "4111-1111"})
        return Finish({"reads": len(ctx.steps)})

    tool = make_tool("console_read", body)
    tool.sensitive_fields = ("card",)
    register(tool, ScriptedAgent("console_reader", decide, tools=("console_read",)))
    return body


@pytest.fixture
def admin_user(django_user_model):
    user = django_user_model.objects.create_user(username="ada", password="pw-ada")
    user.groups.add(Group.objects.get(name="admin"))
    return user


def _new(system_actor, **input) -> Run:
    return run_create(agent_name="console_reader", input=input, actor=system_actor)


def _url(name: str, run: Run | uuid.UUID) -> str:
    return reverse(f"runs:{name}", args=[getattr(run, "id", run)])


def _seq(run: Run) -> int:
    return Run.objects.values_list("event_seq", flat=True).get(id=run.id)


# --- the page -------------------------------------------------------------------------------


def test_anonymous_is_sent_to_sign_in(client, reader, system_actor):
    run = _new(system_actor)
    response = client.get(_url("detail", run))
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


def test_a_user_without_a_role_is_forbidden(client, reader, system_actor):
    run = _new(system_actor)
    client.force_login(get_user_model().objects.create_user(username="nobody", password="pw"))
    assert client.get(_url("detail", run)).status_code == 403


@pytest.mark.parametrize(
    ("role", "may_operate"),
    [("viewer", False), ("approver", False), ("operator", True), ("admin_user", True)],
)
def test_every_role_may_look_and_only_operators_see_the_actions(
    client, reader, system_actor, request, role, may_operate
):
    run = _new(system_actor)
    client.force_login(request.getfixturevalue(role))

    response = client.get(_url("detail", run))

    assert response.status_code == 200
    html = response.content.decode()
    assert (_url("pause", run) in html) is may_operate
    assert (_url("terminate", run) in html) is may_operate
    assert ("needs the operator role" in html) is not may_operate


def test_unknown_run_is_404(client, viewer):
    client.force_login(viewer)
    assert client.get(_url("detail", uuid.uuid4())).status_code == 404


def test_page_shows_status_budget_lease_calls_and_state(client, viewer, reader, system_actor):
    run = drive(_new(system_actor).id)
    assert run.status == Run.Status.SUCCEEDED
    client.force_login(viewer)

    response = client.get(_url("detail", run))

    assert response.status_code == 200
    html = response.content.decode()
    assert '<span class="badge badge-succeeded">succeeded</span>' in html
    assert "console_reader" in html and f"v{run.agent_version}" in html
    assert run.trace_id in html
    # budget as a <meter>, never an inline style
    assert f'<meter min="0" max="{run.max_steps}" value="3"' in html
    assert "style=" not in html and "<style" not in html
    # tool calls: key, attempts, masked arguments, receipt
    assert f"{run.id}:1" in html and f"{run.id}:2" in html
    assert "4111-1111" not in html and "***" in html
    assert 'succeeded <span class="muted">from tool' in html
    # the state as JSON
    assert "&quot;" not in response.context["state_json"]
    assert response.context["state_json"] in html.replace("&quot;", '"')
    # a terminal run is not polled
    assert "every 3s" not in html
    # a viewer sees no action forms
    assert _url("terminate", run) not in html
    assert "needs the operator role" in html


def test_live_run_polls_its_summary_and_the_summary_says_what_changed(
    client, operator, reader, system_actor
):
    run = _new(system_actor)
    run.refresh_from_db()
    client.force_login(operator)
    html = client.get(_url("detail", run)).content.decode()
    assert "every 3s" in html
    acts = "pause,terminate,budget,fork"
    assert f"part=summary&amp;seen={run.event_seq}&amp;acts={acts}" in html

    unchanged = client.get(
        _url("detail", run),
        {"part": "summary", "seen": run.event_seq, "acts": acts},
        HTTP_HX_REQUEST="true",
    )
    assert unchanged.status_code == 200
    assert "HX-Trigger" not in unchanged
    assert "<html" not in unchanged.content.decode()

    # a worker taking the run changes events but not the actions on offer
    engine.claim(run.id, worker="w-1")
    claimed = client.get(
        _url("detail", run),
        {"part": "summary", "seen": run.event_seq, "acts": acts},
        HTTP_HX_REQUEST="true",
    )
    assert claimed["HX-Trigger"] == "run-changed"
    assert "<code>w-1</code>" in claimed.content.decode()

    Run.objects.filter(id=run.id).update(lease_expires_at=None)  # as if it had released
    run_pause(run_id=run.id, actor=system_actor)
    changed = client.get(
        _url("detail", run),
        {"part": "summary", "seen": run.event_seq, "acts": acts},
        HTTP_HX_REQUEST="true",
    )
    assert changed["HX-Trigger"] == "run-changed, run-actions-changed"
    assert "badge-paused" in changed.content.decode()

    timeline = client.get(_url("detail", run), {"part": "timeline"}, HTTP_HX_REQUEST="true")
    assert 'id="run-timeline"' in timeline.content.decode()
    assert "paused by system" in timeline.content.decode()


def _detail_queries(client, run, django_assert_num_queries, n: int) -> None:
    with django_assert_num_queries(n):
        assert client.get(_url("detail", run)).status_code == 200


def test_query_count_is_pinned_and_does_not_grow_with_steps(
    client, operator, reader, system_actor, django_assert_num_queries
):
    small = drive(_new(system_actor, reads=2).id)
    big = drive(_new(system_actor, reads=60).id, max_slices=200)
    assert big.status == Run.Status.SUCCEEDED and big.steps_used == 61
    client.force_login(operator)
    client.get(_url("detail", small))  # session and permission caches are per request anyway

    # session, user, user + group permissions, run, events, calls, call count, approval
    # requests, fork points, steps named by the events, open waits, forks, and the receipts
    # of tools that declare a sensitive output (runs.masking; the demo's lookup_order does)
    _detail_queries(client, small, django_assert_num_queries, 14)
    _detail_queries(client, big, django_assert_num_queries, 14)


def test_the_polled_summary_is_cheap(
    client, operator, reader, system_actor, django_assert_num_queries
):
    run = drive(_new(system_actor, reads=30).id, max_slices=100)
    client.force_login(operator)
    # session, user, user + group permissions, the run
    with django_assert_num_queries(5):
        response = client.get(
            _url("detail", run), {"part": "summary", "seen": 0}, HTTP_HX_REQUEST="true"
        )
    assert response.status_code == 200


def test_a_run_that_needs_a_person_says_what_to_do(client, viewer, reader, system_actor):
    run = _new(system_actor)
    Run.objects.filter(id=run.id).update(
        status=Run.Status.NEEDS_ATTENTION,
        reason_code=Run.Reason.INCOMPATIBLE_AGENT_VERSION,
        reason_detail="no migration from 1 to 2",
    )
    client.force_login(viewer)

    html = client.get(_url("detail", run)).content.decode()

    assert "<code>incompatible_agent_version</code> — no migration from 1 to 2" in html
    assert "What to do:</strong> No state migration reaches the registered version" in html


def test_a_run_whose_precondition_raised_offers_a_retry(client, operator, reader, system_actor):
    run = _new(system_actor)
    Run.objects.filter(id=run.id).update(
        status=Run.Status.NEEDS_ATTENTION,
        reason_code=Run.Reason.PRECONDITION_FAILED,
        reason_detail="the precondition of refund_payment raised: KeyError: 'ord_1'",
    )
    client.force_login(operator)

    html = client.get(_url("detail", run)).content.decode()

    assert "What to do:</strong> A tool&#x27;s precondition raised" in html
    assert f'action="{_url("retry_recovery", run)}"' in html
    assert ">Retry</button>" in html

    response = client.post(_url("retry_recovery", run), {})

    assert response.status_code in (200, 302)
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    assert "retried by user:" in client.get(_url("detail", run)).content.decode()


def test_long_run_shows_the_latest_events_and_loads_older_ones(
    client, viewer, reader, system_actor
):
    run = drive(_new(system_actor, reads=60).id, max_slices=200)
    client.force_login(viewer)

    page = client.get(_url("detail", run))

    shown = page.context["detail"].events
    assert len(shown) == 100 and shown[-1].seq == run.event_seq
    oldest = shown[0].seq
    html = page.content.decode()
    assert f"{_url('events', run)}?before={oldest}" in html
    assert 'id="event-1"' not in html

    older = client.get(_url("events", run), {"before": oldest}, HTTP_HX_REQUEST="true")
    assert older.status_code == 200
    older_html = older.content.decode()
    assert "<html" not in older_html
    assert f'id="event-{oldest - 1}"' in older_html
    assert 'id="event-1"' in older_html  # fewer than 100 remain: the first page is reached
    assert "Load older events" not in older_html

    # without JavaScript the link is a page of its own
    plain = client.get(_url("events", run), {"before": oldest})
    assert plain.status_code == 200 and "<html" in plain.content.decode()
    assert client.get(_url("events", run), {"before": "x"}).status_code == 400


# --- a timeline across a recovery --------------------------------------------------------------


@pytest.fixture
def crashy(register):
    """A reconcilable tool whose first call applies its effect and then the worker dies."""
    applied: dict[str, dict] = {}
    plan = {"die": 1}

    def behaviour(arguments, ctx):
        applied[ctx.idempotency_key] = {"ok": True}
        if plan["die"]:
            plan["die"] -= 1
            raise WorkerKilled

    def lookup(key, arguments):
        if key in applied:
            return Reconciliation(
                LookupResult.FOUND, result=applied[key], external_ref="ext-" + key
            )
        return Reconciliation(LookupResult.ABSENT)

    def decide(ctx):
        if not ctx.steps:
            return CallTool("console_apply", {"amount": 5})
        return Finish({"ok": True})

    body = CountingTool(behaviour)
    register(
        make_tool("console_apply", body, effect=Effect.RECONCILABLE, reconcile=lookup),
        ScriptedAgent("console_crashy", decide, tools=("console_apply",)),
    )
    return body


def test_timeline_across_a_recovery_shows_both_incarnations(client, viewer, crashy, system_actor):
    run = run_create(agent_name="console_crashy", actor=system_actor)
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w-2")  # dies after the effect, before recording it
    expire_lease(run.id)
    run = drive(run.id, worker="w-5")
    assert run.status == Run.Status.SUCCEEDED and len(crashy.calls) == 1
    client.force_login(viewer)

    response = client.get(_url("detail", run))

    groups = [g for g in response.context["groups"] if g.kind == "incarnation"]
    assert [(g.incarnation, g.worker, g.recovered) for g in groups] == [
        (1, "w-2", False),
        (2, "w-5", True),
    ]
    first, second = groups
    assert (first.end, first.lost_at, first.taken_over_by) == ("lost", "dispatching", "w-5")
    assert "reconciled call #1 (console_apply) → succeeded" in second.notes
    assert second.end == "released" and "succeeded" in second.end_text
    html = response.content.decode()
    assert "Incarnation 1 · worker w-2 claimed the run" in html
    assert "Incarnation 2 · worker w-5 took over after a lost lease" in html
    assert "w-2 lost its lease at <code>dispatching</code>; w-5 took over" in html
    assert "w-5 resumed at" in html and "reconciled call #1 (console_apply) → succeeded" in html


def test_a_live_lease_is_shown_as_held(client, viewer, reader, system_actor):
    run = _new(system_actor)
    assert engine.claim(run.id, worker="w-9") is not None
    client.force_login(viewer)

    response = client.get(_url("detail", run))

    (group,) = [g for g in response.context["groups"] if g.kind == "incarnation"]
    assert (group.worker, group.end) == ("w-9", "holding")
    html = response.content.decode()
    assert "<code>w-9</code> · expires" in html


# --- actions: the permissions matrix ----------------------------------------------------------


def _queued(system_actor) -> Run:
    return run_create(agent_name="console_reader", actor=system_actor)


def _paused(system_actor) -> Run:
    run = _queued(system_actor)
    return run_pause(run_id=run.id, actor=system_actor)


def _dead_lettered(system_actor) -> Run:
    run = _queued(system_actor)
    Run.objects.filter(id=run.id).update(
        status=Run.Status.NEEDS_ATTENTION, reason_code=Run.Reason.RECOVERY_LIMIT, recovery_count=4
    )
    return run


def _finished(system_actor) -> Run:
    return drive(_queued(system_actor).id)


ACTIONS = {
    # action: (make a run it applies to, form data, status afterwards, event, text in timeline)
    "pause": (_queued, {"reason": "maintenance"}, Run.Status.PAUSED, "run.paused", "paused by"),
    "resume": (_paused, {}, Run.Status.QUEUED, "run.resumed", "resumed by"),
    "terminate": (
        _queued,
        {"reason": "wrong order", "confirm": "on"},
        Run.Status.TERMINATED,
        "run.terminated",
        "terminated by",
    ),
    "budget": (
        _queued,
        {"add_steps": "5"},
        Run.Status.QUEUED,
        "run.budget_topped_up",
        "budget topped up by",
    ),
    "retry_recovery": (
        _dead_lettered,
        {},
        Run.Status.QUEUED,
        "run.recovery_retried",
        "recovery retried by",
    ),
    "fork": (_finished, {"from_step": "1"}, Run.Status.SUCCEEDED, "run.forked", "forked by"),
}


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_anonymous_cannot_act(client, reader, system_actor, action):
    make, data, *_ = ACTIONS[action]
    run = make(system_actor)
    before = _seq(run)

    response = client.post(_url(action, run), data)

    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    assert _seq(run) == before


@pytest.mark.parametrize("role", ["viewer", "approver"])
@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_roles_without_operate_are_refused_with_a_message(
    client, reader, system_actor, request, role, action
):
    make, data, *_ = ACTIONS[action]
    run = make(system_actor)
    before = (_seq(run), Run.objects.get(id=run.id).status)
    client.force_login(request.getfixturevalue(role))

    response = client.post(_url(action, run), data)

    assert response.status_code == 403
    assert "runs.operate_run" in response.content.decode()
    assert (_seq(run), Run.objects.get(id=run.id).status) == before
    htmx = client.post(_url(action, run), data, HTTP_HX_REQUEST="true")
    assert htmx.status_code == 403 and "<html" not in htmx.content.decode()
    assert "runs.operate_run" in htmx.content.decode()
    assert (_seq(run), Run.objects.get(id=run.id).status) == before


@pytest.mark.parametrize("role", ["operator", "admin_user"])
@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_operators_act_and_the_action_appears_in_the_timeline_naming_them(
    client, reader, system_actor, request, role, action
):
    make, data, status, event_type, text = ACTIONS[action]
    run = make(system_actor)
    user = request.getfixturevalue(role)
    client.force_login(user)

    response = client.post(_url(action, run), data)

    assert response.status_code == 302
    run.refresh_from_db()
    assert run.status == (Run.Status.SUCCEEDED if action == "fork" else status)
    (event,) = events(run.id, event_type)
    assert (event.actor, event.channel) == (f"user:{user.username}", "web")
    target = response["Location"]
    if action == "fork":
        fork = Run.objects.get(forked_from=run)
        assert target == _url("detail", fork)
        assert fork.forked_from_step == 1 and fork.status == Run.Status.QUEUED
    else:
        assert target == _url("detail", run)
    followed = client.get(target).content.decode()
    assert '<p class="notice">' in followed  # the success message, once
    page = client.get(_url("detail", run))
    html = page.content.decode()
    assert f"{text} user:{user.username}" in html
    assert page.context["groups"][-1].entries[-1].type in (event_type, "run.forked")
    assert '<p class="notice">' not in html


def test_htmx_action_returns_the_actions_panel_with_a_message_and_a_trigger(
    client, operator, reader, system_actor
):
    run = _queued(system_actor)
    client.force_login(operator)

    response = client.post(_url("pause", run), {"reason": ""}, HTTP_HX_REQUEST="true")

    assert response.status_code == 200
    assert response["HX-Trigger"] == "run-changed, runs-changed"
    html = response.content.decode()
    assert html.lstrip().startswith('<section class="panel run-actions" id="run-actions"')
    assert 'id="run-flash" class="run-flash" role="status" hx-swap-oob="true"' in html
    assert "The run is paused." in html
    # the summary comes along, so its next poll starts from the paused state
    assert 'id="run-summary" hx-swap-oob="true"' in html
    assert "acts=resume,terminate,budget,fork" in html
    assert _url("resume", run) in html and _url("pause", run) not in html


def test_running_run_pause_is_a_request_the_worker_honours(client, operator, reader, system_actor):
    run = _queued(system_actor)
    engine.claim(run.id, worker="w-1")
    client.force_login(operator)

    response = client.post(_url("pause", run), {"reason": "look"}, follow=True)

    assert "Pause requested" in response.content.decode()
    run.refresh_from_db()
    assert (run.status, run.requested_action) == (Run.Status.RUNNING, "pause")
    assert "pause requested by user:olivia: look" in response.content.decode()


# --- bad input changes nothing -------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "data", "message"),
    [
        ("terminate", {"confirm": "on"}, "Give a reason"),
        ("terminate", {"reason": "   ", "confirm": "on"}, "Give a reason"),
        ("terminate", {"reason": "wrong order"}, "Tick the box to confirm"),
        ("budget", {}, "Raise at least one limit"),
        ("budget", {"add_steps": "-3"}, "greater than or equal to 0"),
        ("budget", {"add_cost": "abc"}, "Enter a number"),
        ("budget", {"deadline": "2001-01-01T00:00"}, "must be in the future"),
        ("budget", {"deadline": "soon"}, "Enter a valid date/time"),
        ("fork", {}, "Choose the last finished step"),
        ("fork", {"from_step": "99"}, "the run has no step 99"),
    ],
)
def test_bad_input_shows_a_form_error_and_changes_nothing(
    client, operator, reader, system_actor, action, data, message
):
    run = _finished(system_actor) if action == "fork" else _queued(system_actor)
    before = (_seq(run), Run.objects.filter(id=run.id).values().get())
    client.force_login(operator)

    response = client.post(_url(action, run), data)

    assert response.status_code == 400
    assert message in response.content.decode()
    assert (_seq(run), Run.objects.filter(id=run.id).values().get()) == before
    assert not Run.objects.filter(forked_from=run).exists()

    htmx = client.post(_url(action, run), data, HTTP_HX_REQUEST="true")
    assert htmx.status_code == response.status_code  # base.html has htmx swap 4xx in
    assert 'id="run-actions"' in htmx.content.decode() and "<html" not in htmx.content.decode()
    assert message in htmx.content.decode() and "HX-Trigger" not in htmx
    assert _seq(run) == before[0]


@pytest.mark.parametrize(
    ("action", "make", "data", "message"),
    [
        ("resume", _queued, {}, "a queued run cannot be resumed"),
        ("pause", _finished, {}, "a succeeded run cannot be paused"),
        ("terminate", _finished, {"reason": "x", "confirm": "on"}, "run is already succeeded"),
        ("retry_recovery", _queued, {}, "only a run stopped at its recovery limit"),
        ("budget", _finished, {"add_steps": "1"}, "budget cannot be topped up"),
    ],
)
def test_an_action_the_run_refuses_is_a_message_not_a_500(
    client, operator, reader, system_actor, action, make, data, message
):
    run = make(system_actor)
    before = _seq(run)
    client.force_login(operator)

    response = client.post(_url(action, run), data)

    assert response.status_code == 409
    assert message in response.content.decode()
    assert _seq(run) == before


def test_actions_refuse_get_and_unknown_runs(client, operator):
    client.force_login(operator)
    missing = uuid.uuid4()
    assert client.get(_url("pause", missing)).status_code == 405
    assert client.post(_url("pause", missing), {}).status_code == 404
    assert (
        client.post(_url("terminate", missing), {"reason": "x", "confirm": "on"}).status_code == 404
    )


def test_actions_need_the_csrf_token(operator, reader, system_actor):
    from django.test import Client

    run = _queued(system_actor)
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)

    assert client.post(_url("pause", run), {}).status_code == 403
    assert Run.objects.get(id=run.id).status == Run.Status.QUEUED


def test_budget_top_up_of_an_exhausted_run_queues_it_again(client, operator, reader, system_actor):
    run = run_create(
        agent_name="console_reader", input={"reads": 5}, actor=system_actor, max_steps=2
    )
    run = drive(run.id)
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")
    client.force_login(operator)
    page = client.get(_url("detail", run)).content.decode()
    assert _url("budget", run) in page and '<meter min="0" max="2" value="2"' in page

    deadline = (timezone.localtime() + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    response = client.post(
        _url("budget", run), {"add_steps": "10", "deadline": deadline}, follow=True
    )

    assert "Budget topped up; the run is queued again." in response.content.decode()
    run.refresh_from_db()
    assert (run.status, run.max_steps, run.steps_used) == (Run.Status.QUEUED, 12, 2)
    assert run.deadline is not None
    (event,) = events(run.id, "run.budget_topped_up")
    assert event.payload["after"]["max_steps"] == 12
    assert drive(run.id).status == Run.Status.SUCCEEDED


def test_fork_from_the_page_opens_the_new_run_linked_to_the_old(
    client, operator, reader, system_actor
):
    run = _finished(system_actor)
    client.force_login(operator)
    page = client.get(_url("detail", run))
    assert page.context["detail"].fork_steps == [2, 1]
    assert "A new run on console_reader <strong>v1</strong> carries over" in page.content.decode()

    response = client.post(_url("fork", run), {"from_step": "2"}, HTTP_HX_REQUEST="true")

    fork = Run.objects.get(forked_from=run)
    assert response.status_code == 204 and response["HX-Redirect"] == _url("detail", fork)
    page = client.get(_url("detail", fork)).content.decode()
    assert f'href="{_url("detail", run)}"' in page and "at step #2" in page
    assert Step.objects.filter(run=fork).count() == 2
    parent = client.get(_url("detail", run)).content.decode()
    assert f'href="{_url("detail", fork)}"' in parent
    assert "run.forked" in event_types(run.id) and "run.forked" in event_types(fork.id)


def test_waiting_on_people_links_the_pending_approval(client, viewer, register, system_actor):
    from runs.registry import ApprovalPolicy

    def decide(ctx):
        return CallTool("console_pay", {"amount": 3}) if not ctx.steps else Finish({})

    register(
        make_tool("console_pay", CountingTool(), approval=ApprovalPolicy(when="always")),
        ScriptedAgent("console_payer", decide, tools=("console_pay",)),
    )
    run = drive(run_create(agent_name="console_payer", actor=system_actor).id)
    assert run.status == Run.Status.WAITING_APPROVAL
    (requested,) = events(run.id, "approval.requested")
    client.force_login(viewer)

    html = client.get(_url("detail", run)).content.decode()

    approval_id = requested.payload["approval"]
    assert f'href="{reverse("approvals:detail", args=[approval_id])}"' in html
    assert f"approval #{approval_id}" in html
    groups = client.get(_url("detail", run)).context["groups"]
    assert groups[-1].end == "released" and "waiting on approval" in groups[-1].end_text


def test_waiting_on_people_links_the_question(client, operator, register, system_actor):
    from runs.registry import AskQuestion

    def decide(ctx):
        if not ctx.steps:
            return AskQuestion("Ship to the new address?", choices=["yes", "no"])
        return Finish({})

    register(ScriptedAgent("console_asker", decide))
    run = drive(run_create(agent_name="console_asker", actor=system_actor).id)
    assert run.status == Run.Status.WAITING_EVENT
    client.force_login(operator)

    html = client.get(_url("detail", run)).content.decode()

    question = run.questions.get()
    groups = client.get(_url("detail", run)).context["groups"]
    assert groups[-1].end == "released" and groups[-1].end_text.startswith("released the lease")
    assert "Waiting on people" in html
    assert reverse("runs:question", args=[question.id]) in html
    assert "Ship to the new address?" in html


def test_event_payloads_never_carry_a_sensitive_value(client, viewer, reader, system_actor):
    run = drive(_new(system_actor).id)
    client.force_login(viewer)
    html = client.get(_url("detail", run)).content.decode()
    assert "4111-1111" not in html  # the whole value: "4111" alone occurs in random ids
    assert RunEvent.objects.filter(run=run, type="step.decided").exists()


def test_resolving_from_the_run_page_points_to_the_inbox(client, operator, register, system_actor):
    from runs.registry import OutcomeUnknown

    def lose(arguments, ctx):
        raise OutcomeUnknown("connection reset")

    def decide(ctx):
        return CallTool("console_unsafe", {}) if not ctx.steps else Finish({})

    register(
        make_tool("console_unsafe", CountingTool(lose), effect=Effect.UNSAFE),
        ScriptedAgent("console_unsafe_agent", decide, tools=("console_unsafe",)),
    )
    run = drive(run_create(agent_name="console_unsafe_agent", actor=system_actor).id)
    assert run.status == Run.Status.NEEDS_ATTENTION
    client.force_login(operator)

    html = client.get(_url("detail", run)).content.decode()

    call = run.tool_calls.get()
    assert f"{reverse('runs:unknown')}#call-{call.id}" in html
    assert "unknown_outcome" in html


# --- the timeline builder (pure functions) -------------------------------------------------


def _ev(number, type, actor, incarnation, **payload):
    from types import SimpleNamespace

    return SimpleNamespace(
        seq=number,
        type=type,
        actor=actor,
        channel="worker" if actor.startswith("worker:") else "web",
        incarnation=incarnation,
        payload=payload,
        created_at=timezone.now(),
        run_id="r",
    )


def test_builder_separates_people_from_incarnations_and_names_where_a_lease_was_lost():
    from runs import timeline

    groups = timeline.build(
        [
            _ev(1, "run.created", "system", 0, agent="a", agent_version="1"),
            _ev(2, "run.claimed", "worker:w-1", 1, worker="w-1", fence=1, recovered=False),
            _ev(3, "step.decided", "worker:w-1", 1, seq=1, kind="tool_call", tool="t"),
            _ev(4, "run.waiting", "worker:w-1", 1, on="approval", seq=1, tool="t"),
            _ev(5, "approval.decided", "user:alice", 1, approval=3, decision="approve"),
            _ev(6, "run.claimed", "worker:w-2", 2, worker="w-2", fence=2, recovered=False),
            _ev(7, "tool.dispatching", "worker:w-2", 2, seq=1, tool="t", attempt=1),
            _ev(8, "run.pause_requested", "user:olivia", 2, by="user:olivia", reason="look"),
            _ev(9, "run.claimed", "worker:w-3", 3, worker="w-3", fence=3, recovered=True),
        ],
        lease=timeline.LeaseNow(owner="w-3", fence=3, live=True),
    )

    assert [(g.kind, g.incarnation, g.end) for g in groups] == [
        ("outside", None, ""),
        ("incarnation", 1, "released"),
        ("outside", None, ""),
        ("incarnation", 2, "lost"),
        ("incarnation", 3, "holding"),
    ]
    assert groups[2].entries[0].text == "approval #3 approve by user:alice"
    # an operator's request while w-2 held the lease stays with that incarnation
    assert [e.type for e in groups[3].entries][-1] == "run.pause_requested"
    assert (groups[3].lost_at, groups[3].taken_over_by) == ("dispatching", "w-3")
    assert groups[4].title == "Incarnation 3 · worker w-3 took over after a lost lease"
    # each claim says why it happened: the first, after the approval, after a lost lease
    assert groups[1].title == "Incarnation 1 · worker w-1 claimed the run"
    assert groups[3].title == (
        "Incarnation 2 · worker w-2 resumed the run after the approval was decided"
    )


def test_a_claim_says_what_it_resumed_after():
    from runs import timeline

    causes = [
        ("run.recovery_retried", "after an operator's retry"),
        ("run.signalled", "after a signal"),
        ("run.budget_topped_up", "after a budget top-up"),
        ("run.released", "for its next slice"),
    ]
    for event_type, cause in causes:
        groups = timeline.build(
            [
                _ev(1, "run.claimed", "worker:w-1", 1, worker="w-1", fence=1, recovered=False),
                _ev(2, "run.released", "worker:w-1", 1, status="queued"),
                _ev(3, event_type, "user:olivia", 1, by="user:olivia"),
                _ev(4, "run.claimed", "worker:w-1", 2, worker="w-1", fence=2, recovered=False),
            ],
            lease=timeline.LeaseNow(owner="w-1", fence=2, live=True),
        )
        assert groups[-1].title == f"Incarnation 2 · worker w-1 resumed the run {cause}"
        assert "w-1 resumed at" in groups[-1].summary and cause in groups[-1].summary


def test_builder_marks_a_window_that_starts_or_ends_inside_an_incarnation():
    from runs import timeline

    groups = timeline.build(
        [
            _ev(50, "tool.succeeded", "worker:w-1", 4, seq=9, source="reconciliation"),
            _ev(51, "step.decided", "worker:w-1", 4, seq=10, kind="tool_call", tool="t"),
        ],
        continued=True,
        continues=True,
    )

    (group,) = groups
    assert group.continued and group.continues and group.end == ""
    assert group.title == "Incarnation 4 · worker w-1 (earlier events not shown)"
    assert group.notes == ["reconciled call #9 → succeeded"]


def test_a_top_up_past_what_the_record_can_hold_is_refused_not_a_500(
    client, operator, reader, system_actor
):
    from decimal import Decimal

    run = run_create(agent_name="console_reader", actor=system_actor, max_cost=Decimal(999_999))
    before = _seq(run)
    client.force_login(operator)

    response = client.post(_url("budget", run), {"add_cost": "999999"})

    assert response.status_code == 400
    assert "must stay below 10^6" in response.content.decode()
    assert _seq(run) == before and Run.objects.get(id=run.id).max_cost == Decimal(999_999)


def test_older_events_need_a_sensible_event_number(client, viewer, reader, system_actor):
    run = _new(system_actor)
    client.force_login(viewer)
    for before in ("", "x", "0", "-3", str(2**70)):
        assert client.get(_url("events", run), {"before": before}).status_code == 400
    assert client.get(_url("events", uuid.uuid4()), {"before": "5"}).status_code == 404


@pytest.mark.parametrize("htmx", [False, True])
def test_errors_of_a_form_not_on_the_page_are_shown_as_the_page_error(
    client, operator, reader, system_actor, htmx
):
    """A fork posted for a run with no finished step (or a pause of a paused run with a too
    long reason): the form is not on the page, so its errors are the page's error (found by
    tests/runs/test_forms_fuzzed.py: a 400 that showed nothing)."""
    client.force_login(operator)
    extra = {"HTTP_HX_REQUEST": "true"} if htmx else {}
    fork = client.post(_url("fork", _queued(system_actor)), {}, **extra)
    pause = client.post(_url("pause", _paused(system_actor)), {"reason": "x" * 2001}, **extra)

    assert (fork.status_code, pause.status_code) == (400, 400)
    assert 'role="alert">Choose the last finished step' in fork.content.decode()
    assert 'role="alert">Ensure this value has at most 2000 characters' in pause.content.decode()
