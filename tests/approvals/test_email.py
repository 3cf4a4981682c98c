"""Approval emails over a real SMTP conversation, and the link they carry, end to end."""

from __future__ import annotations

import pytest
from django.core import mail
from django.test import Client

from approvals.models import Approval, ApprovalLink
from runs import outbox
from runs.links import hash_token
from runs.models import OutboxMessage, Run
from tests.approvals.conftest import CUSTOMER_EMAIL, LINK_PATH, link, requested, start_refund
from tests.conftest import drive
from tests.support import event_types, events, refund_posts, refunds

pytestmark = pytest.mark.usefixtures("roles")


def _text_and_html(message) -> tuple[str, str]:
    assert message.get_content_type() == "multipart/alternative"
    text = message.get_body(preferencelist=("plain",)).get_content()
    html = message.get_body(preferencelist=("html",)).get_content()
    return text, html


@pytest.mark.django_db(transaction=True)
def test_emailed_link_approves_over_real_smtp_and_the_run_refunds_once(
    sandbox, system_actor, smtp_server, alice, bob
):
    # bob is the run's principal: he may not approve his own run, so he gets no email
    run = start_refund(system_actor, principal=bob)

    assert run.status == Run.Status.WAITING_APPROVAL
    approval = Approval.objects.get(run=run)
    assert [rcpts for _, rcpts in smtp_server.envelopes] == [["alice@example.com"]]
    (message,) = smtp_server.messages
    # what is asked, in one line: the amount with its currency, the sensitive email masked
    assert message["Subject"] == (
        f"Approval needed: Refund 500.00 EUR to order ord_1004 (customer ***) "
        f"(run {str(run.id)[:8]}, refund)"
    )
    text, html = _text_and_html(message)
    for body in (text, html):
        assert "Refund 500.00 EUR to order ord_1004" in body
        assert "UTC" in body  # the expiry says its zone
        assert str(run.id) in body
        assert "refund" in body  # the agent
        assert "refund_payment" in body
        assert "reconcilable" in body  # the risk
        assert "50000" in body  # the exact arguments ...
        assert "***" in body
        assert CUSTOMER_EMAIL not in body  # ... with the sensitive field masked
        assert approval.expires_at.strftime("%Y-%m-%d %H:%M") in body
    token = LINK_PATH.search(text).group(1)
    assert LINK_PATH.search(html).group(1) == token
    assert len(token) >= 43  # 32 random bytes
    link_row = ApprovalLink.objects.get(approval=approval)
    assert link_row.token_hash == hash_token(token) and token not in link_row.token_hash
    (sent,) = events(run.id, "approval.email_sent")
    assert (sent.channel, sent.payload["to"]) == ("email", "alice")

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(alice)  # a link decides for its recipient, signed in
    page = browser.get(link(token))  # what a mail scanner does, too

    assert page.status_code == 200
    assert b"Approve" in page.content and b"Reject" in page.content
    assert b"csrfmiddlewaretoken" in page.content
    approval.refresh_from_db()
    assert approval.status == Approval.Status.PENDING
    assert "approval.decided" not in event_types(run.id)

    refused = browser.post(link(token), {"decision": "approve"})  # no CSRF token
    assert refused.status_code == 403
    approval.refresh_from_db()
    assert approval.status == Approval.Status.PENDING

    csrf = browser.cookies["csrftoken"].value
    decided = browser.post(
        link(token),
        {"decision": "approve", "csrfmiddlewaretoken": csrf, "comment": "ok", "confirm": "yes"},
    )

    assert decided.status_code == 200
    assert b"has been decided" in decided.content
    approval.refresh_from_db()
    assert approval.status == Approval.Status.APPROVED
    (used,) = events(run.id, "approval.link_used")
    (decision,) = events(run.id, "approval.decided")
    assert (used.actor, used.channel) == ("user:alice", "email")
    assert (decision.actor, decision.channel) == ("user:alice", "email")
    assert used.seq < decision.seq

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1
    (refund,) = refunds(sandbox)
    assert refund["amount_cents"] == 50_000

    again = browser.get(link(token))
    assert again.status_code == 200
    assert b"alice" in again.content and b"approved" in again.content
    assert b"cannot be used again" in again.content
    assert b'name="decision"' not in again.content


@pytest.mark.django_db(transaction=True)
def test_a_server_that_drops_the_connection_after_accepting_gets_the_same_message_again(
    sandbox, system_actor, dropping_smtp_server, alice, bob
):
    """The mail server keeps the message and drops the connection before its final reply:
    the sender cannot tell it arrived, so it sends it again — the same message, recognisable
    by its Message-ID, with the same working link."""
    run = start_refund(system_actor, principal=bob)
    (row,) = OutboxMessage.objects.filter(kind="approval.request")
    assert (row.status, row.attempts) == ("pending", 1)
    assert "SMTPServerDisconnected" in row.last_error
    (failed,) = events(run.id, "approval.email_failed")
    assert failed.payload["to"] == "alice"
    assert len(dropping_smtp_server.messages) == 1  # it did arrive

    OutboxMessage.objects.update(next_attempt_at=None)  # the backoff has passed
    assert outbox.outbox_drain_due() == 1

    first, second = dropping_smtp_server.messages
    assert first["Message-ID"] == second["Message-ID"] == row.message_id
    tokens = {LINK_PATH.search(_text_and_html(m)[0]).group(1) for m in (first, second)}
    assert len(tokens) == 1
    row.refresh_from_db()
    assert (row.status, row.attempts) == ("sent", 2)
    (sent,) = events(run.id, "approval.email_sent")
    assert sent.payload["attempt"] == 2
    browser = Client()
    browser.force_login(alice)
    assert b'name="decision"' in browser.get(link(tokens.pop())).content


@pytest.mark.django_db
def test_every_eligible_approver_gets_their_own_link(
    django_capture_on_commit_callbacks, sandbox, system_actor, alice, bob, django_user_model
):
    from django.contrib.auth.models import Group

    no_address = django_user_model.objects.create_user(username="carol", password="pw")
    no_address.groups.add(Group.objects.get(name="approver"))
    outsider = django_user_model.objects.create_user(
        username="dan", password="pw", email="dan@example.com"
    )
    outsider.groups.add(Group.objects.get(name="operator"))

    run, approval = requested(django_capture_on_commit_callbacks, system_actor)

    assert sorted(m.to[0] for m in mail.outbox) == ["alice@example.com", "bob@example.com"]
    tokens = {LINK_PATH.search(m.body).group(1) for m in mail.outbox}
    assert len(tokens) == 2
    links = ApprovalLink.objects.filter(approval=approval)
    assert {link.approver.username for link in links} == {"alice", "bob"}
    assert {link.token_hash for link in links} == {hash_token(t) for t in tokens}
    assert all(m.alternatives[0][1] == "text/html" for m in mail.outbox)
    assert len(events(run.id, "approval.email_sent")) == 2


@pytest.mark.django_db
def test_no_email_is_sent_before_the_request_commits(sandbox, system_actor, alice):
    # without the commit callbacks running (the test's transaction never commits)
    run = start_refund(system_actor)

    assert run.status == Run.Status.WAITING_APPROVAL
    assert mail.outbox == []
    assert ApprovalLink.objects.filter(approval__run=run).count() == 1  # made, not sent


@pytest.mark.django_db
def test_a_failing_mail_server_is_recorded_and_the_approval_stays_decidable(
    django_capture_on_commit_callbacks, sandbox, system_actor, alice, settings
):
    from approvals.services import approval_decide
    from runs.actors import Actor

    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", 9, 2

    run, approval = requested(django_capture_on_commit_callbacks, system_actor)

    assert run.status == Run.Status.WAITING_APPROVAL
    (failed,) = events(run.id, "approval.email_failed")
    assert failed.payload["to"] == "alice"
    approval_decide(approval_id=approval.id, decision="approve", actor=Actor.for_user(alice, "web"))
    approval.refresh_from_db()
    assert approval.status == Approval.Status.APPROVED


@pytest.mark.django_db
def test_the_principal_is_told_when_their_approval_is_rejected(
    django_capture_on_commit_callbacks, sandbox, system_actor, alice, operator
):
    from approvals.services import approval_decide
    from runs.actors import Actor

    operator.email = "olivia@example.com"
    operator.save(update_fields=["email"])
    run, approval = requested(django_capture_on_commit_callbacks, system_actor, principal=operator)
    mail.outbox.clear()

    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(
            approval_id=approval.id,
            decision="reject",
            comment="order was already refunded",
            actor=Actor.for_user(alice, "web"),
        )

    (notice,) = mail.outbox
    assert notice.to == ["olivia@example.com"]
    assert "rejected" in notice.subject
    assert "order was already refunded" in notice.body
    assert CUSTOMER_EMAIL not in notice.body
    assert [e.payload["kind"] for e in events(run.id, "approval.email_sent")] == [
        "request",
        "notice_rejected",
    ]
