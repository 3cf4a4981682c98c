"""Emailed approval links: GET decides nothing; a tampered, expired, reused or
other-approver token decides nothing and shows a clear page; concurrent decisions settle
once."""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.test import Client
from django.utils import timezone

from approvals.models import Approval, ApprovalDecision, ApprovalLink
from approvals.services import (
    AlreadyDecided,
    approval_decide,
    approval_link_get,
)
from runs.actors import Actor
from runs.links import LinkInvalid
from runs.registry import ApprovalPolicy, CallTool, Effect, Finish
from runs.services import run_create
from tests.approvals.conftest import link, requested, start_refund, token_for
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, close_connection, events, make_tool

pytestmark = pytest.mark.usefixtures("roles")


def _snapshot(approval: Approval) -> tuple:
    approval.refresh_from_db()
    run = approval.run
    run.refresh_from_db()
    return (
        approval.status,
        run.status,
        ApprovalDecision.objects.filter(approval=approval).count(),
        list(ApprovalLink.objects.filter(approval=approval).values_list("used_at", flat=True)),
        len(events(run.id, "approval.decided")),
    )


def _post(client: Client, token: str, decision: str = "approve", *, sign_in=True, **data):
    """POST the link's form as its recipient would: signed in as the link's approver (unless
    ``sign_in=False`` or someone is signed in already), the confirmation box ticked."""
    if sign_in and "_auth_user_id" not in client.session:
        with contextlib.suppress(LinkInvalid):
            client.force_login(approval_link_get(token).approver)
    return client.post(link(token), {"decision": decision, "confirm": "yes", **data})


@pytest.mark.django_db
def test_a_get_decides_nothing_however_often_it_comes(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    before = _snapshot(approval)

    for _ in range(3):
        page = client.get(link(token))
        assert page.status_code == 200
        assert b"Approve" in page.content
    assert client.head(link(token)).status_code == 200

    assert _snapshot(approval) == before
    assert events(approval.run_id, "approval.link_used") == []
    assert page["Referrer-Policy"] == "same-origin"
    assert "no-store" in page["Cache-Control"]


@pytest.mark.django_db
def test_a_tampered_token_decides_nothing(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    tampered = token[:-1] + ("A" if token[-1] != "A" else "B")
    before = _snapshot(approval)

    for bad in (tampered, token[:20], "x" * 300):
        assert client.get(link(bad)).status_code == 404
        page = _post(client, bad)
        assert page.status_code == 404
        assert b"This link is not valid" in page.content

    assert _snapshot(approval) == before


@pytest.mark.django_db
def test_an_expired_link_decides_nothing(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    # expired, and no sweeper has run yet: the page and the service both refuse it
    Approval.objects.filter(id=approval.id).update(expires_at=timezone.now() - timedelta(seconds=5))
    before = _snapshot(approval)

    page = client.get(link(token))
    assert page.status_code == 410
    assert b"has expired" in page.content
    assert b'name="decision"' not in page.content
    posted = _post(client, token)
    assert posted.status_code == 410
    assert b"has expired" in posted.content

    assert _snapshot(approval) == before


@pytest.mark.django_db
def test_a_used_link_cannot_decide_again_and_shows_the_decision(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    assert _post(client, token, "reject", comment="wrong order").status_code == 200
    before = _snapshot(approval)

    again = _post(client, token, "approve")

    assert again.status_code == 409
    assert b"already been used" in again.content
    assert _snapshot(approval) == before
    assert approval.status == Approval.Status.REJECTED
    shown = client.get(link(token))
    assert shown.status_code == 200
    decision = ApprovalDecision.objects.get(approval=approval)
    for text in ("alice", "rejected", "via email", "wrong order", f"{decision.created_at:%H:%M}"):
        assert text.encode() in shown.content


@pytest.mark.django_db
def test_another_signed_in_approver_cannot_use_a_link(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice, bob
):
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    client.force_login(bob)
    before = _snapshot(approval)

    page = client.get(link(token))
    assert page.status_code == 403
    assert b"sent to someone else" in page.content
    assert b"sent to alice" in page.content
    assert _post(client, token).status_code == 403

    assert _snapshot(approval) == before


@pytest.mark.django_db
def test_a_link_of_someone_no_longer_an_approver_decides_nothing(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    alice.groups.remove(Group.objects.get(name="approver"))
    before = _snapshot(approval)

    page = _post(client, token)

    assert page.status_code == 403
    assert b"cannot decide" in page.content
    assert _snapshot(approval) == before


@pytest.mark.django_db
def test_rejecting_through_a_link_needs_a_reason(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    before = _snapshot(approval)

    page = _post(client, token, "reject", comment="  ")

    assert page.status_code == 400
    assert b"Give a reason" in page.content
    assert _snapshot(approval) == before


@pytest.mark.django_db
def test_a_comment_over_the_limit_is_refused_not_cut(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    before = _snapshot(approval)

    page = _post(client, token, "reject", comment="x" * 2001)

    assert page.status_code == 400
    assert b"at most 2000 characters" in page.content
    assert _snapshot(approval) == before


@pytest.mark.django_db
def test_a_link_after_someone_else_decided_shows_their_decision(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice, bob
):
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    approval_decide(approval_id=approval.id, decision="approve", actor=Actor.for_user(bob, "web"))
    before = _snapshot(approval)

    shown = client.get(link(token))
    posted = _post(client, token, "reject", comment="no")

    assert shown.status_code == 200 and b"has been decided" in shown.content
    assert b"bob" in shown.content
    assert posted.status_code == 409
    assert _snapshot(approval) == before


@pytest.fixture
def login_policy_tool(register):
    body = CountingTool()

    def decide(ctx):
        if not ctx.steps:
            return CallTool("close_account", {"account": "acc_1"})
        return Finish({"status": ctx.last_step.status})

    register(
        make_tool(
            "close_account",
            body,
            effect=Effect.IDEMPOTENT,
            approval=ApprovalPolicy(when="always", require_login=True),
        ),
        ScriptedAgent("closer", decide, tools=("close_account",)),
    )
    return body


@pytest.mark.django_db
def test_a_policy_can_require_login_as_well_as_the_token(
    django_capture_on_commit_callbacks, client, system_actor, alice, login_policy_tool
):
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(run_create(agent_name="closer", actor=system_actor).id)
    approval = Approval.objects.get(run=run)
    assert approval.require_login
    token = token_for("alice@example.com")
    before = _snapshot(approval)

    page = client.get(link(token))
    assert page.status_code == 200
    assert b"Sign in to decide" in page.content
    assert b'name="decision"' not in page.content
    posted = _post(client, token, sign_in=False)
    assert posted.status_code == 302 and posted["Location"].startswith("/accounts/login/")
    assert _snapshot(approval) == before

    client.force_login(alice)
    assert _post(client, token).status_code == 200
    approval.refresh_from_db()
    assert approval.status == Approval.Status.APPROVED
    assert events(run.id, "approval.link_used")[0].payload["signed_in"] is True
    run = drive(run.id)
    assert run.result == {"status": "completed"}
    assert len(login_policy_tool.calls) == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_decisions_exactly_one_wins(sandbox, system_actor, alice, bob, settings):
    """alice approves through her emailed link while bob rejects on the web page, at once."""
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    run = start_refund(system_actor)
    approval = Approval.objects.get(run=run)
    token = token_for("alice@example.com")
    barrier = threading.Barrier(2)
    outcomes: dict[str, str] = {}

    def by_link():
        try:
            barrier.wait()
            signed_in = Client()
            signed_in.force_login(alice)
            response = signed_in.post(link(token), {"decision": "approve", "confirm": "yes"})
            outcomes["alice"] = "won" if response.status_code == 200 else str(response.status_code)
        finally:
            close_connection()

    def by_page():
        try:
            barrier.wait()
            approval_decide(
                approval_id=approval.id,
                decision="reject",
                comment="not this one",
                actor=Actor.for_user(bob, "web"),
            )
            outcomes["bob"] = "won"
        except AlreadyDecided:
            outcomes["bob"] = "already_decided"
        finally:
            close_connection()

    threads = [threading.Thread(target=by_link), threading.Thread(target=by_page)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert sorted(outcomes.values()) in (["409", "won"], ["already_decided", "won"])
    approval.refresh_from_db()
    winner = "alice" if outcomes["alice"] == "won" else "bob"
    expected = {"alice": Approval.Status.APPROVED, "bob": Approval.Status.REJECTED}[winner]
    assert approval.status == expected
    assert ApprovalDecision.objects.filter(approval=approval).count() == 1
    assert [e.payload["settled"] for e in events(run.id, "approval.decided")] == [True]
    link_row = ApprovalLink.objects.get(approval=approval, approver=alice)
    assert (link_row.used_at is not None) == (winner == "alice")


@pytest.mark.django_db
def test_a_forwarded_link_decides_nothing_for_its_new_holder(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    """The token alone is not enough (DESIGN §9): whoever holds alice's forwarded email is
    asked to sign in as alice, and decides nothing."""
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    before = _snapshot(approval)

    page = client.get(link(token))
    posted = _post(client, token, sign_in=False)

    assert b"Sign in to decide" in page.content
    assert posted.status_code == 302
    assert _snapshot(approval) == before


@pytest.mark.django_db
def test_a_form_submitted_as_it_is_decides_nothing(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    """A mail scanner that submits the page's form without a person ticking the box."""
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    client.force_login(alice)
    before = _snapshot(approval)

    page = client.post(link(token), {"decision": "approve"})

    assert page.status_code == 400
    assert b"Tick the box" in page.content
    assert _snapshot(approval) == before


@pytest.mark.django_db
def test_a_link_records_where_its_decision_came_from(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    token = token_for("alice@example.com")
    client.force_login(alice)

    client.post(
        link(token),
        {"decision": "approve", "confirm": "yes"},
        HTTP_USER_AGENT="Mail/1.0",
        REMOTE_ADDR="203.0.113.9",
    )

    (used,) = events(approval.run_id, "approval.link_used")
    assert (used.payload["client_ip"], used.payload["user_agent"]) == ("203.0.113.9", "Mail/1.0")


@pytest.fixture
def bearer_policy_tool(register):
    body = CountingTool()

    def decide(ctx):
        if not ctx.steps:
            return CallTool("bearer_close", {})
        return Finish({"status": ctx.last_step.status})

    register(
        make_tool(
            "bearer_close",
            body,
            effect=Effect.IDEMPOTENT,
            approval=ApprovalPolicy(when="always", bearer_links=True),
        ),
        ScriptedAgent("bearer_closer", decide, tools=("bearer_close",)),
    )
    return body


@pytest.mark.django_db
def test_bearer_links_are_an_opt_in_for_one_approver(
    django_capture_on_commit_callbacks, client, system_actor, alice, bearer_policy_tool
):
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(run_create(agent_name="bearer_closer", actor=system_actor).id)
    token = token_for("alice@example.com")

    assert _post(client, token, sign_in=False).status_code == 200

    assert Approval.objects.get(run=run).status == Approval.Status.APPROVED
    assert events(run.id, "approval.link_used")[0].payload["signed_in"] is False
    with pytest.raises(ValueError, match="1-of-1"):
        ApprovalPolicy(when="always", required=2, bearer_links=True)


@pytest.mark.django_db
def test_signing_in_from_a_link_keeps_its_token_out_of_the_sign_in_url(
    django_capture_on_commit_callbacks, client, system_actor, alice, login_policy_tool
):
    """The sign-in page's ``next=`` would put the token in access logs and Referer headers:
    the link waits in the session, and ``next=`` names a page without a secret (issue 17)."""
    import re
    from urllib.parse import unquote

    with django_capture_on_commit_callbacks(execute=True):
        drive(run_create(agent_name="closer", actor=system_actor).id)
    token = token_for("alice@example.com")

    page = client.get(link(token)).content.decode()
    (sign_in_url,) = re.findall(r'href="(/accounts/login/[^"]*)"', page)
    sign_in_url = sign_in_url.replace("&amp;", "&")
    assert token not in unquote(sign_in_url)
    assert unquote(sign_in_url).endswith("next=/approvals/signed-in/")
    posted = _post(client, token, sign_in=False)
    assert token not in unquote(posted["Location"])

    alice.set_password("a-long-passphrase-of-alice")
    alice.save()
    signed_in = client.post(
        sign_in_url, {"username": alice.username, "password": "a-long-passphrase-of-alice"}
    )
    assert signed_in.status_code == 302 and signed_in["Location"] == "/approvals/signed-in/"
    onward = client.get(signed_in["Location"])
    assert onward.status_code == 302 and onward["Location"] == link(token)
    assert b'name="decision"' in client.get(onward["Location"]).content
    # used once: the same page again goes to the inbox
    assert client.get("/approvals/signed-in/")["Location"] == "/approvals/"
