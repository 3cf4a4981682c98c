"""What only approval links have (the rest, every kind alike: tests/runs/test_links.py):
the confirmation box, the decisions shown, a comment's limit, separation of duties, a
policy's sign-in and bearer links; concurrent decisions settle once."""

from __future__ import annotations

import contextlib
import re
import threading

import pytest
from django.contrib.auth.models import Group
from django.core import mail
from django.test import Client

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
from tests.approvals.conftest import CUSTOMER_EMAIL, link, requested, start_refund, token_for
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
def test_the_link_page_says_what_is_asked_in_the_emails_words(
    django_capture_on_commit_callbacks, client, sandbox, system_actor, alice
):
    """The subject's one-line summary, money with its currency, sensitive fields masked."""
    _, approval = requested(django_capture_on_commit_callbacks, system_actor)
    (message,) = [m for m in mail.outbox if "alice@example.com" in m.to]
    client.force_login(alice)

    page = client.get(link(token_for("alice@example.com"))).content.decode()

    summary = re.search(r"<strong>(Refund [^<]*)</strong>", page).group(1)
    assert summary in message.subject
    assert "EUR to order ord_1004" in summary
    assert CUSTOMER_EMAIL not in page
