"""The dashboard at ``/``: counts, the "needs me" list, worker health, recent events; the base
layout's navigation and the operator's timezone (docs/operations.md, "Console and alerts")."""

from __future__ import annotations

import re
import uuid
import zoneinfo
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.db import connection
from django.utils import timezone

from approvals.models import Approval
from runs.models import Alert, Run, Step, ToolCall, Worker
from runs.services import run_create
from tests.conftest import _user_in

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

DASHBOARD = "/"


@pytest.fixture(autouse=True)
def _patient_liveness(settings):
    # the test settings call a worker dead after 3 s without a heartbeat (for crash tests);
    # here a slow, busy test machine must not kill the "live" workers these tests make
    settings.AGENTOPS = {**settings.AGENTOPS, "WORKER_STALE_AFTER": 120.0}


def _run(actor, *, goal: str = "g", status: str = Run.Status.QUEUED, reason: str = "", detail=""):
    run = run_create(
        agent_name="refund",
        goal=goal,
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=actor,
    )
    Run.objects.filter(id=run.id).update(status=status, reason_code=reason, reason_detail=detail)
    return Run.objects.get(id=run.id)


def _unknown_call(run: Run, *, seq: int = 1, tool: str = "refund_payment") -> ToolCall:
    step = Step.objects.create(run=run, seq=seq, kind=Step.Kind.TOOL_CALL, incarnation=1)
    return ToolCall.objects.create(
        step=step,
        run=run,
        tool_name=tool,
        tool_version="v1",
        effect="reconcilable",
        arguments={},
        arguments_masked={},
        arguments_digest="d",
        idempotency_key=f"{run.id}:{seq}",
        status=ToolCall.Status.UNKNOWN,
        attempt_count=1,
    )


def _approval(run: Run, *, expires_in: timedelta, seq: int = 2, tool: str = "refund_payment"):
    step = Step.objects.create(run=run, seq=seq, kind=Step.Kind.TOOL_CALL, incarnation=1)
    call = ToolCall.objects.create(
        step=step,
        run=run,
        tool_name=tool,
        tool_version="v1",
        effect="reconcilable",
        arguments={},
        arguments_masked={},
        arguments_digest="d",
        idempotency_key=f"{run.id}:{seq}",
        status=ToolCall.Status.AWAITING_APPROVAL,
    )
    return Approval.objects.create(
        run=run,
        tool_call=call,
        tool_name=tool,
        tool_version="v1",
        arguments_digest="d",
        approver_group="approver",
        expires_at=timezone.now() + expires_in,
    )


def _worker(name: str, *, heartbeat_ago: float = 0, health: str = Worker.Health.HEALTHY):
    now = timezone.now()
    return Worker.objects.create(
        name=name,
        host="host-a",
        pid=4242,
        boot_id=uuid.uuid4(),
        started_at=now - timedelta(minutes=5),
        heartbeat_at=now - timedelta(seconds=heartbeat_ago),
        health=health,
    )


# --- access -----------------------------------------------------------------------------------


def test_anonymous_is_sent_to_sign_in(client):
    response = client.get(DASHBOARD)
    assert response.status_code == 302
    assert response["Location"] == "/accounts/login/?next=/"


@pytest.mark.parametrize(
    ("role", "status"),
    [("viewer", 200), ("operator", 200), ("approver", 200), ("admin", 200), ("nobody", 403)],
)
def test_who_sees_the_dashboard(client, django_user_model, role, status):
    user = django_user_model.objects.create_user(username=f"u-{role}", password="pw")
    if role != "nobody":
        user.groups.add(Group.objects.get(name=role))
    client.force_login(user)
    assert client.get(DASHBOARD).status_code == status


# --- what it shows ----------------------------------------------------------------------------


def test_counts_by_status_link_to_the_filtered_list(client, viewer, system_actor):
    _run(system_actor, status=Run.Status.SUCCEEDED)
    _run(system_actor, status=Run.Status.SUCCEEDED)
    _run(system_actor, status=Run.Status.FAILED)
    client.force_login(viewer)

    response = client.get(DASHBOARD)

    counts = {c["status"]: c["count"] for c in response.context["status_counts"]}
    assert counts["succeeded"] == 2 and counts["failed"] == 1 and counts["queued"] == 0
    html = response.content.decode()
    assert re.search(
        r'href="/runs/\?status=succeeded">\s*<span class="count">2</span>\s*'
        r'<span class="badge badge-succeeded">succeeded</span>',
        html,
    )
    assert "3 runs in all" in html


def _kinds(response) -> list[tuple[str, str]]:
    return [(item.kind, item.key) for item in response.context["needs_you"].items]


def test_needs_you_lists_one_entry_per_thing_a_person_must_do(
    client, django_user_model, system_actor
):
    # an operator who also approves and resolves calls (issue 21 item 3)
    me = _user_in(django_user_model, "nina", "operator", "approver")
    parked = _run(
        system_actor,
        goal="stuck",
        status=Run.Status.NEEDS_ATTENTION,
        reason=Run.Reason.RECOVERY_LIMIT,
        detail="recovered 11 times",
    )
    # the engine gave up on this call: its run waits for a person — one thing, not two
    given_up = _run(system_actor, status=Run.Status.NEEDS_ATTENTION, reason="unknown_outcome")
    call = _unknown_call(given_up)
    # the engine still reconciles this one by itself: nothing for a person to do
    _unknown_call(_run(system_actor, status=Run.Status.RUNNING))
    waiting = _run(system_actor, goal="Refund order ord_1001", status="waiting_approval")
    later = _approval(waiting, expires_in=timedelta(days=3), tool="send_email")
    sooner = _approval(waiting, expires_in=timedelta(minutes=5), seq=3)
    # another group's approval, and one already past its expiry
    _approval(waiting, expires_in=timedelta(hours=1), seq=4).__class__.objects.filter(
        tool_call__step__seq=4
    ).update(approver_group="finance")
    _approval(waiting, expires_in=-timedelta(minutes=1), seq=5)
    client.force_login(me)

    response = client.get(DASHBOARD)

    assert _kinds(response) == [
        ("approval", f"approval:{sooner.id}"),
        ("approval", f"approval:{later.id}"),
        ("needs_attention", f"run:{parked.id}"),
        ("unknown_outcome", f"toolcall:{call.id}"),
    ] or _kinds(response) == [
        ("approval", f"approval:{sooner.id}"),
        ("approval", f"approval:{later.id}"),
        ("unknown_outcome", f"toolcall:{call.id}"),
        ("needs_attention", f"run:{parked.id}"),
    ]
    html = response.content.decode()
    assert 'Needs you <span class="count">4</span>' in html
    assert '<code class="reason">recovery_limit</code>' in html
    assert "recovered 11 times" in html
    assert f'href="/unknown/#call-{call.id}"' in html
    assert f'href="/approvals/{sooner.id}/"' in html
    # each entry links to its run, named by agent, goal and short id
    assert (
        f'href="/runs/{waiting.id}/" title="run {waiting.id}">refund · Refund order ord_1001 · {str(waiting.id)[:8]}</a>'
        in html
    )

    # the badge in the navigation counts the same list
    badge = client.get("/needs-you/badge/").content.decode()
    assert '<span class="nav-badge">4</span>' in badge


def test_needs_you_leaves_out_approvals_i_may_not_decide(client, approver, system_actor):
    # a run whose principal is the approver: nobody approves their own action
    mine = _run(system_actor, status="waiting_approval")
    Run.objects.filter(id=mine.id).update(principal=approver)
    _approval(mine, expires_in=timedelta(minutes=30))
    client.force_login(approver)
    response = client.get(DASHBOARD)
    assert _kinds(response) == []
    assert "Nothing needs you right now." in response.content.decode()
    # and an approver is not sent to runs they may not operate on
    _run(system_actor, status=Run.Status.NEEDS_ATTENTION, reason="recovery_limit")
    assert _kinds(client.get(DASHBOARD)) == []


def test_nothing_needs_me_says_so(client, operator):
    _worker("w-1")
    client.force_login(operator)
    html = client.get(DASHBOARD).content.decode()
    assert "Nothing needs you right now." in html
    assert "No events yet." in html
    assert 'role="alert"' not in html  # a live worker: no red banner


def test_no_worker_at_all_shows_a_red_banner(client, viewer):
    client.force_login(viewer)
    html = client.get(DASHBOARD).content.decode()
    assert '<p class="alarm" role="alert">' in html
    assert "No worker is running" in html
    assert "python manage.py runworker" in html  # the empty state says what to do


def test_only_stale_or_stopped_workers_show_a_red_banner(client, viewer):
    _worker("w-dead", heartbeat_ago=3600)
    _worker("w-stopped", health=Worker.Health.STOPPED)
    client.force_login(viewer)
    html = client.get(DASHBOARD).content.decode()
    assert "No worker is running" in html
    assert '<span class="badge badge-worker-dead">no heartbeat</span>' in html
    assert '<span class="badge badge-worker-stopped">stopped</span>' in html


def test_a_frozen_cluster_shows_a_red_banner(client, viewer):
    _worker("w-1")
    frozen = _worker("w-2", health=Worker.Health.FROZEN)
    Worker.objects.filter(name="w-2").update(detail="no task ran for 95s while 3 wait")
    client.force_login(viewer)

    html = client.get(DASHBOARD).content.decode()

    assert "The worker cluster looks frozen (w-2)" in html
    assert '<span class="badge badge-worker-frozen">frozen</span>' in html
    assert "no task ran for 95s while 3 wait" in html
    assert frozen.name in html


def test_healthy_workers_are_listed_with_their_heartbeat(client, viewer):
    _worker("w-1", heartbeat_ago=2)
    client.force_login(viewer)
    response = client.get(DASHBOARD)
    html = response.content.decode()
    assert response.context["health"].live == 1
    assert '<span class="badge badge-worker-healthy">healthy</span>' in html
    assert "just now" in html
    assert 'role="alert"' not in html


def test_each_worker_says_which_agent_versions_it_serves(client, viewer):
    _worker("w-1", heartbeat_ago=2)
    Worker.objects.filter(name="w-1").update(
        serves={"agents": {"refund": ["1"], "rolling": ["1", "2"]}, "tools": {}}
    )
    client.force_login(viewer)

    html = client.get(DASHBOARD).content.decode()

    assert "serves refund v1 · rolling v1, v2" in html


def test_recent_events_newest_first_with_actor(client, viewer, operator, system_actor):
    from runs.actors import Actor
    from runs.services import run_terminate

    first = _run(system_actor, goal="first")
    second = _run(system_actor, goal="second")
    run_terminate(run_id=first.id, actor=Actor.for_user(operator, "web"), reason="test")
    client.force_login(viewer)

    response = client.get(DASHBOARD)

    events = response.context["events"]
    assert [(e.type, e.run.id) for e in events[:3]] == [
        ("run.terminated", first.id),
        ("run.created", second.id),
        ("run.created", first.id),
    ]
    html = response.content.decode()
    assert "<code>run.terminated</code>" in html and "user:olivia" in html


def test_htmx_refresh_gets_only_the_live_part(client, viewer):
    client.force_login(viewer)
    html = client.get(DASHBOARD, headers={"HX-Request": "true"}).content.decode()
    assert html.lstrip().startswith('<div id="dashboard-live"')
    # the navigation's "Needs you" badge comes along out of band: the same count as the list
    assert 'id="needs-you-badge"' in html and 'hx-swap-oob="true">Needs you' in html
    assert "<html" not in html and "topbar" not in html
    assert 'hx-trigger="every 5s, runs-changed from:body"' in html


@pytest.mark.parametrize("scale", [1, 6])
def test_query_count_is_constant(
    client, django_user_model, system_actor, django_assert_num_queries, scale
):
    operator = _user_in(django_user_model, "nina", "operator", "approver")
    for i in range(scale):
        parked = _run(system_actor, status=Run.Status.NEEDS_ATTENTION, reason="unknown_outcome")
        Alert.objects.create(cause=f"c{i}", kind=Alert.Kind.RUN_NEEDS_ATTENTION, run=parked)
        _unknown_call(parked)
        waiting = _run(system_actor, status=Run.Status.WAITING_APPROVAL)
        _approval(waiting, expires_in=timedelta(minutes=10 + i))
        _worker(f"w-{i}")
    client.force_login(operator)

    # session, user, permissions (user + group), counts; "Needs you": unknown calls given up
    # on, parked runs, open questions, pending approvals, my groups, my decisions, my API
    # tokens, the runs I drove (separation of duties), and twice the receipts of tools that
    # declare a sensitive output (runs.masking: the calls' reasons, the approvals); workers,
    # recent events, recent alerts, undelivered emails and webhook deliveries, the spend
    # caps (none here: their counters are not read); on PostgreSQL the counts read the
    # table's size estimate first (selectors.run_status_counts)
    estimate = 1 if connection.vendor == "postgresql" else 0
    with django_assert_num_queries(21 + estimate):
        page = client.get(DASHBOARD)
    with django_assert_num_queries(21 + estimate):
        partial = client.get(DASHBOARD, headers={"HX-Request": "true"})
    assert page.status_code == partial.status_code == 200
    assert page.context["needs_you"].count == 2 * scale  # each unknown call, each approval


# --- layout: navigation, timezone -------------------------------------------------------------


def test_navigation_offers_each_page_the_user_may_see(client, viewer, operator, django_user_model):
    client.force_login(viewer)
    html = client.get(DASHBOARD).content.decode()
    nav = html[html.index('<nav class="mainnav"') : html.index("</nav>")]
    assert 'href="/" aria-current="page">Dashboard</a>' in nav
    assert 'href="/runs/">Runs</a>' in nav
    assert 'href="/unknown/">Unknown outcomes</a>' in nav
    assert 'href="/questions/">Questions</a>' in nav
    assert "Approvals" not in nav and "Admin" not in nav  # a viewer sees no approvals

    client.force_login(operator)
    nav = client.get("/runs/").content.decode()
    assert 'href="/approvals/">Approvals</a>' in nav
    assert 'href="/runs/" aria-current="page">Runs</a>' in nav

    staff = django_user_model.objects.create_user(username="sam", password="pw", is_staff=True)
    staff.groups.add(Group.objects.get(name="viewer"))
    client.force_login(staff)
    assert 'href="/admin/">Admin</a>' in client.get(DASHBOARD).content.decode()


def test_times_show_in_the_operators_timezone(client, viewer, system_actor):
    run = _run(system_actor, status=Run.Status.NEEDS_ATTENTION, reason="unknown_outcome")
    client.force_login(viewer)
    utc = client.get(DASHBOARD).content.decode()
    assert ' UTC">' in utc  # the server's default before the browser said otherwise

    client.cookies["tz"] = "Asia/Tokyo"
    tokyo = client.get(DASHBOARD).content.decode()
    local = timezone.localtime(run.updated_at, timezone=zoneinfo.ZoneInfo("Asia/Tokyo"))
    assert f'title="{local:%Y-%m-%d %H:%M:%S} JST"' in tokyo
    # the machine-readable time stays UTC ISO 8601
    assert f'datetime="{run.updated_at.isoformat()}"' in tokyo

    client.cookies["tz"] = "Not/AZone"
    assert client.get(DASHBOARD).status_code == 200
    client.cookies["tz"] = "../../etc/passwd"
    assert ' UTC">' in client.get(DASHBOARD).content.decode()


def test_pages_have_no_inline_scripts_or_styles(client, operator, system_actor):
    _run(system_actor, status=Run.Status.NEEDS_ATTENTION)
    client.force_login(operator)
    for url in ("/", "/runs/", "/runs/start/"):
        html = client.get(url).content.decode()
        assert "style=" not in html and "<style" not in html
        assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), url
        assert 'src="/static/js/timezone.js"' in html


def test_relative_time_filter():
    from runs.templatetags.console import ago

    now = timezone.now()
    assert ">just now</time>" in ago(now)
    assert ">3\xa0minutes ago</time>" in ago(now - timedelta(minutes=3, seconds=5))
    assert ">in 2\xa0hours</time>" in ago(now + timedelta(hours=2, minutes=1))
    assert ago(None) == "—"


def test_the_api_keeps_answering_in_utc_whatever_the_cookie(client, viewer, system_actor):
    run = _run(system_actor)
    client.force_login(viewer)
    client.cookies["tz"] = "Asia/Tokyo"
    response = client.get(f"/api/v1/runs/{run.id}/")
    assert response.status_code == 200
    created = response.json()["created_at"]
    assert created.endswith(("Z", "+00:00")), created


def test_recent_alerts_say_whether_operators_were_emailed(client, viewer, system_actor):
    from runs import alerts

    parked = _run(system_actor, status=Run.Status.NEEDS_ATTENTION, reason="recovery_limit")
    _worker("w-live")
    _worker("w-frozen", health=Worker.Health.FROZEN)
    alerts.alerts_check()
    client.force_login(viewer)

    html = client.get(DASHBOARD).content.decode()

    section = html[html.index('id="alerts-heading"') :]
    # the run named by agent, goal and short id (issue 21)
    assert f"{str(parked.id)[:8]}</a>\n              needs attention" in section
    assert "<code>w-frozen</code>\n              worker looks frozen" in section
    assert section.count('<span class="result-ok">emailed</span>') == 2


def test_approvals_are_shown_only_to_who_may_decide_them(client, viewer, system_actor):
    waiting = _run(system_actor, status=Run.Status.WAITING_APPROVAL)
    _approval(waiting, expires_in=timedelta(minutes=5))
    client.force_login(viewer)  # viewers do not decide approvals
    response = client.get(DASHBOARD)
    assert response.context["needs_you"].items == []
    assert "/approvals/" not in response.content.decode()


def test_a_poll_after_the_session_expired_sends_the_whole_page_to_sign_in(client):
    for url in ("/", "/runs/?status=queued"):
        response = client.get(url, headers={"HX-Request": "true"})
        assert response.status_code == 204
        assert response["HX-Redirect"].startswith("/accounts/login/?next=")
    # without htmx: the ordinary redirect
    assert client.get("/").status_code == 302


def test_htmx_swaps_refusals_and_form_errors_in(client, viewer):
    # 4xx answers carry the message the operator must see: the page tells htmx to swap them
    client.force_login(viewer)
    html = client.get(DASHBOARD).content.decode()
    assert '{"code": "4..", "swap": true, "error": true}' in html
