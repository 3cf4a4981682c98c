"""The outbox (runs.outbox, DESIGN §9): an email is a row written with the state change that
calls for it, claimed, checked again just before the send, marked after; retried with
backoff; given up on after the maximum number of attempts, where operators can see it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core import mail
from django.core.mail import EmailMessage
from django.db import transaction
from django.utils import timezone

from runs import links, outbox
from runs.models import OutboxMessage
from tests.runs.test_metrics import scrape, value

pytestmark = pytest.mark.django_db

KIND = "test.hello"


@pytest.fixture(autouse=True)
def _hello_kind():
    outbox.register_kind(KIND, render=lambda row: EmailMessage(subject="hello", body="hi"))
    yield
    outbox._kinds.pop(KIND, None)


def _enqueue(to: str = "ann@example.com") -> OutboxMessage:
    (row_id,) = outbox.emails_enqueue([outbox.Email(kind=KIND, to_address=to, payload={})])
    return OutboxMessage.objects.get(id=row_id)


def _refuse(self, messages):
    raise ConnectionRefusedError("smtp down")


def test_the_message_is_sent_after_the_commit_with_its_message_id(
    django_capture_on_commit_callbacks,
):
    with django_capture_on_commit_callbacks(execute=True):
        row = _enqueue()
        assert mail.outbox == []  # not before the commit

    (message,) = mail.outbox
    assert message.to == ["ann@example.com"]
    assert message.extra_headers["Message-ID"] == row.message_id
    row.refresh_from_db()
    assert (row.status, row.attempts, row.claim_token) == ("sent", 1, "")
    assert row.sent_at is not None


def test_a_rolled_back_transaction_leaves_no_message(django_capture_on_commit_callbacks):
    with (
        django_capture_on_commit_callbacks(execute=True),
        pytest.raises(RuntimeError),
        transaction.atomic(),
    ):
        _enqueue()
        raise RuntimeError("the state change failed")
    assert not OutboxMessage.objects.exists() and mail.outbox == []


def test_a_message_its_process_never_sent_is_sent_by_the_sweeper_once():
    row = _enqueue()  # committed; the process died before its after-commit send

    assert outbox.outbox_drain_due() == 1
    assert outbox.outbox_drain_due() == 0
    assert [m.extra_headers["Message-ID"] for m in mail.outbox] == [row.message_id]


def test_a_drainer_whose_claim_was_taken_over_sends_nothing():
    """Drainer A claims and freezes; its claim runs out, B takes the message over and sends
    it; A wakes up: the pre-send check refuses it, the message went out once."""
    row = _enqueue()
    claim_a = outbox.claim(OutboxMessage, row.id, attempts=0)
    assert claim_a
    assert outbox.outbox_drain_due() == 0  # held by A
    OutboxMessage.objects.filter(id=row.id).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1)  # A's claim ran out
    )
    assert outbox.outbox_drain_due() == 1  # B

    assert outbox._send_one(row, claim_a) is False  # A, awake again
    assert len(mail.outbox) == 1
    assert OutboxMessage.objects.get(id=row.id).status == "sent"


def test_too_little_claim_left_for_a_send_is_refused_before_sending(settings):
    row = _enqueue()
    claim = outbox.claim(OutboxMessage, row.id, attempts=0)
    assert outbox.still_claimed(OutboxMessage, row.id, claim)
    # less than the send timeout left: the send could end after another drainer took over
    OutboxMessage.objects.filter(id=row.id).update(
        next_attempt_at=timezone.now() + timedelta(seconds=outbox.send_timeout() / 2)
    )
    assert not outbox.still_claimed(OutboxMessage, row.id, claim)
    assert outbox._send_one(row, claim) is False
    assert mail.outbox == []


def test_failures_are_retried_with_backoff_then_given_up_and_shown(
    settings, monkeypatch, client, operator
):
    settings.AGENTOPS = {**settings.AGENTOPS, "OUTBOX_MAX_ATTEMPTS": 2, "OUTBOX_BACKOFF": 60.0}
    monkeypatch.setattr("django.core.mail.backends.locmem.EmailBackend.send_messages", _refuse)
    row = _enqueue()

    assert outbox.outbox_drain_due() == 0
    row.refresh_from_db()
    assert (row.status, row.attempts) == ("pending", 1)
    assert "smtp down" in row.last_error
    wait = (row.next_attempt_at - timezone.now()).total_seconds()
    assert 50 < wait <= 60  # the backoff, in database time
    assert outbox.outbox_drain_due() == 0 and row.attempts == 1  # not due yet

    client.force_login(operator)
    assert b"1 message being retried" in client.get("/").content

    OutboxMessage.objects.update(next_attempt_at=None)
    assert outbox.outbox_drain_due() == 0
    row.refresh_from_db()
    assert (row.status, row.attempts) == ("failed", 2)
    assert outbox.outbox_drain_due() == 0  # given up: never again

    page = client.get("/").content.decode()
    assert "email given up" in page and "ann@example.com" in page
    samples = scrape(client)
    assert value(samples, "agentops_outbox_messages", channel="email", status="failed") == 1
    assert value(samples, "agentops_outbox_retrying", channel="email") == 0


def test_a_link_token_is_derived_from_a_seed_that_is_dropped_once_sent():
    seed = links.link_seed()
    token = links.link_token(seed)
    assert len(token) >= 43 and links.link_token(seed) == token  # a retry: the same link
    assert links.link_token(links.link_seed()) != token
    (row_id,) = outbox.emails_enqueue(
        [outbox.Email(kind=KIND, to_address="ann@example.com", payload={"seed": seed})]
    )

    outbox.outbox_drain_due()

    assert "seed" not in OutboxMessage.objects.get(id=row_id).payload


def test_a_kind_nobody_renders_any_more_is_cancelled_not_retried():
    row = _enqueue()
    outbox._kinds.pop(KIND)
    assert outbox.outbox_drain_due() == 0
    row.refresh_from_db()
    assert row.status == "cancelled" and mail.outbox == []
