"""Fixtures for the approval email, link and page tests: approvers with email addresses,
a real in-process SMTP server, and helpers that read links out of messages."""

from __future__ import annotations

import email
import email.policy
import re
import socket
import threading
from email.message import EmailMessage

import pytest
from django.core import mail
from django.test import override_settings

from approvals.models import Approval
from runs.models import Run
from runs.services import run_create
from tests.conftest import drive

LARGE_REFUND = {"order_id": "ord_1004", "amount_cents": 50_000}  # order of 2,500.00
CUSTOMER_EMAIL = "dave@example.com"  # ord_1004's customer: a sensitive argument
LINK_PATH = re.compile(r"/approvals/link/([A-Za-z0-9_-]+)/")


@pytest.fixture
def alice(approver):
    approver.email = "alice@example.com"
    approver.save(update_fields=["email"])
    return approver


@pytest.fixture
def bob(second_approver):
    second_approver.email = "bob@example.com"
    second_approver.save(update_fields=["email"])
    return second_approver


def start_refund(system_actor, *, principal=None, input=None) -> Run:
    run = run_create(
        agent_name="refund", input=input or LARGE_REFUND, actor=system_actor, principal=principal
    )
    return drive(run.id)


def requested(capture, system_actor, **kw) -> tuple[Run, Approval]:
    """A large refund parked on its approval, with the request emails sent (locmem)."""
    with capture(execute=True):
        run = start_refund(system_actor, **kw)
    return run, Approval.objects.get(run=run, status=Approval.Status.PENDING)


def token_for(address: str, outbox=None) -> str:
    """The link token in the latest message sent to ``address``."""
    messages = [m for m in (outbox if outbox is not None else mail.outbox) if address in m.to]
    assert messages, f"no email to {address}"
    match = LINK_PATH.search(messages[-1].body)
    assert match, messages[-1].body
    return match.group(1)


def link(token: str) -> str:
    return f"/approvals/link/{token}/"


# --- a real SMTP server --------------------------------------------------------------------


class SmtpInbox:
    """aiosmtpd handler: keeps every message it receives, parsed."""

    def __init__(self) -> None:
        self.messages: list[EmailMessage] = []
        self.envelopes: list[tuple[str, list[str]]] = []
        self.received = threading.Condition()

    async def handle_DATA(self, server, session, envelope):
        raw = envelope.original_content or envelope.content
        message = email.message_from_bytes(raw, policy=email.policy.default)
        with self.received:
            self.messages.append(message)
            self.envelopes.append((envelope.mail_from, list(envelope.rcpt_tos)))
            self.received.notify_all()
        return "250 Message accepted for delivery"

    def to(self, address: str) -> list[EmailMessage]:
        return [m for m in self.messages if address in str(m["To"])]


class DroppingInbox(SmtpInbox):
    """Accepts the first ``drops`` messages (keeps them) and then drops the connection
    before its final reply: the client cannot know the message went through."""

    def __init__(self, drops: int = 1) -> None:
        super().__init__()
        self.drops = drops

    async def handle_DATA(self, server, session, envelope):
        reply = await super().handle_DATA(server, session, envelope)
        if self.drops > 0:
            self.drops -= 1
            server.transport.close()
        return reply


def _free_port() -> int:
    # aiosmtpd's start-up self-check connects to the port it was given: port=0 fails
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def smtp_server():
    yield from _smtp(SmtpInbox())


@pytest.fixture
def dropping_smtp_server():
    yield from _smtp(DroppingInbox())


def _smtp(inbox: SmtpInbox):
    from aiosmtpd.controller import Controller

    port = _free_port()
    controller = Controller(inbox, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        with override_settings(
            EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend",
            EMAIL_HOST="127.0.0.1",
            EMAIL_PORT=port,
            EMAIL_USE_TLS=False,
            EMAIL_USE_SSL=False,
            EMAIL_TIMEOUT=5,
        ):
            yield inbox
    finally:
        controller.stop()
