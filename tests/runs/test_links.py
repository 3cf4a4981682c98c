"""Emailed links, every kind alike (runs.links, runs.views.links; docs/links.md): each test
runs for an approval's link and for a question's. A link decides only for its recipient,
signed in, once, before its object expires; opening it decides nothing; a token that is not
a link's, a link sent to someone else, a used or an expired one decides nothing and says
why; what cannot be decided comes back as the form with an error, never a 500.

What only one kind has (an approval's confirmation box, separation of duties and bearer
links; a question's choices and first-answer-wins) is tested beside it:
tests/approvals/test_links.py, tests/runs/test_question_emails.py."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import unquote

import pytest
from django.core import mail
from django.test import Client
from django.utils import timezone

from approvals.models import ApprovalLink
from runs import links
from runs.models import Question, QuestionLink, RunEvent
from runs.services import run_create
from tests.approvals.conftest import requested
from tests.conftest import drive
from tests.support import events

pytestmark = pytest.mark.usefixtures("roles")


@dataclass
class Case:
    """One link of one kind, mailed to ``recipient``; ``other`` is in the same group and got
    their own."""

    kind: str
    token: str
    recipient: Any
    other: Any
    subject: Any  # the approval or the question
    prefix: str  # the URL of a link is prefix + token + "/"
    form_field: bytes  # what only the open form has
    valid: dict[str, str]  # a POST that decides
    invalid: dict[str, str]  # a POST that cannot decide, and what the page then says
    invalid_says: bytes
    done_says: bytes
    signed_in_path: str
    inbox_path: str

    def url(self, token: str | None = None) -> str:
        return f"{self.prefix}{token if token is not None else self.token}/"

    def link_row(self) -> Any:
        model = ApprovalLink if self.kind == "approval" else QuestionLink
        return model.objects.get(token_hash=links.hash_token(self.token))

    def snapshot(self) -> tuple:
        """Everything a decision would change."""
        self.subject.refresh_from_db()
        model = ApprovalLink if self.kind == "approval" else QuestionLink
        field = self.kind
        return (
            self.subject.status,
            sorted(
                model.objects.filter(**{field: self.subject}).values_list("id", "used_at"),
                key=lambda row: row[0],
            ),
            RunEvent.objects.filter(run_id=self.subject.run_id).count(),
        )

    def expire(self) -> None:
        """Past its expiry, before any sweeper or engine has recorded it."""
        type(self.subject).objects.filter(id=self.subject.id).update(
            expires_at=timezone.now() - timedelta(seconds=5)
        )


def _token(address: str, pattern: str) -> str:
    (message, *_) = [m for m in reversed(mail.outbox) if address in m.to]
    return re.search(pattern, message.body).group(1)


def _with_address(user: Any) -> Any:
    user.email = f"{user.username}@example.com"
    user.save(update_fields=["email"])
    return user


def _approval_case(request, capture) -> Case:
    request.getfixturevalue("sandbox")
    alice = _with_address(request.getfixturevalue("approver"))
    bob = _with_address(request.getfixturevalue("second_approver"))
    _, approval = requested(capture, request.getfixturevalue("system_actor"))
    return Case(
        kind="approval",
        token=_token(alice.email, r"/approvals/link/([A-Za-z0-9_-]+)/"),
        recipient=alice,
        other=bob,
        subject=approval,
        prefix="/approvals/link/",
        form_field=b'name="decision"',
        valid={"decision": "approve", "confirm": "yes"},
        invalid={"decision": "reject", "comment": " ", "confirm": "yes"},
        invalid_says=b"Give a reason",
        done_says=b"This approval has been decided",
        signed_in_path="/approvals/signed-in/",
        inbox_path="/approvals/",
    )


def _question_case(request, capture) -> Case:
    olivia = _with_address(request.getfixturevalue("operator"))
    oscar = _with_address(
        request.getfixturevalue("django_user_model").objects.create_user(
            username="oscar", password="pw-oscar"
        )
    )
    oscar.groups.add(*olivia.groups.all())
    with capture(execute=True):
        run = drive(
            run_create(
                agent_name="onboarding",
                input={"customer": "Acme"},
                actor=request.getfixturevalue("system_actor"),
            ).id
        )
    return Case(
        kind="question",
        token=_token(olivia.email, r"/questions/link/([A-Za-z0-9_-]+)/"),
        recipient=olivia,
        other=oscar,
        subject=Question.objects.get(run=run),
        prefix="/questions/link/",
        form_field=b'name="answer"',
        valid={"answer": "pro"},
        invalid={"answer": "platinum"},
        invalid_says=b"must be one of",
        done_says=b"This question has been answered",
        signed_in_path="/questions/signed-in/",
        inbox_path="/questions/",
    )


KINDS = ["approval", "question"]


@pytest.fixture(params=KINDS)
def case(request, django_capture_on_commit_callbacks) -> Case:
    make = _approval_case if request.param == "approval" else _question_case
    return make(request, django_capture_on_commit_callbacks)


def _recipient(case: Case, **kwargs) -> Client:
    browser = Client(**kwargs)
    browser.force_login(case.recipient)
    return browser


@pytest.mark.django_db
def test_a_link_decides_once_for_its_signed_in_recipient(case):
    browser = _recipient(case)

    page = browser.get(case.url())
    assert page.status_code == 200 and case.form_field in page.content

    done = browser.post(
        case.url(), case.valid, REMOTE_ADDR="203.0.113.9", HTTP_USER_AGENT="Mail/1.0"
    )

    assert done.status_code == 200
    assert case.done_says in done.content
    assert b"cannot be used again" in done.content
    assert case.form_field not in done.content
    assert case.link_row().used_at is not None
    (used,) = events(case.subject.run_id, f"{case.kind}.link_used")
    assert (used.actor, used.channel) == (f"user:{case.recipient.username}", "email")
    assert used.payload["signed_in"] is True
    assert (used.payload["client_ip"], used.payload["user_agent"]) == ("203.0.113.9", "Mail/1.0")
    assert case.snapshot()[0] in ("approved", "answered")


@pytest.mark.django_db
def test_opening_a_link_decides_nothing_however_often(case):
    before = case.snapshot()
    for browser in (Client(), _recipient(case)):
        for _ in range(3):
            page = browser.get(case.url())
            assert page.status_code == 200
        assert browser.head(case.url()).status_code == 200

    assert case.snapshot() == before
    assert page["Referrer-Policy"] == "same-origin"
    assert page["X-Robots-Tag"] == "noindex, nofollow"
    assert "no-store" in page["Cache-Control"]


@pytest.mark.django_db
def test_a_post_without_the_csrf_token_decides_nothing(case):
    browser = _recipient(case, enforce_csrf_checks=True)
    before = case.snapshot()

    assert browser.post(case.url(), case.valid).status_code == 403

    assert case.snapshot() == before


@pytest.mark.django_db
def test_a_link_sent_to_someone_else_decides_nothing(case):
    browser = Client()
    browser.force_login(case.other)
    before = case.snapshot()

    page = browser.get(case.url())
    posted = browser.post(case.url(), case.valid)

    assert page.status_code == posted.status_code == 403
    assert b"sent to someone else" in page.content
    assert f"sent to {case.recipient.username}".encode() in page.content
    assert case.form_field not in page.content
    assert case.snapshot() == before


@pytest.mark.django_db
def test_the_token_alone_asks_for_a_sign_in_and_keeps_itself_out_of_its_url(case):
    """A forwarded email or a mail scanner holds the token, not the recipient's session:
    it is asked to sign in, decides nothing, and the sign-in page's ``next=`` names a page
    without the token (the link waits in the session)."""
    browser = Client()
    before = case.snapshot()

    page = browser.get(case.url())
    posted = browser.post(case.url(), case.valid)

    assert page.status_code == 200
    assert b"Sign in" in page.content and case.form_field not in page.content
    (sign_in_url,) = re.findall(r'href="(/accounts/login/[^"]*)"', page.content.decode())
    assert case.token not in unquote(sign_in_url)
    assert unquote(sign_in_url).endswith(f"next={case.signed_in_path}")
    assert posted.status_code == 302 and case.token not in unquote(posted["Location"])
    assert case.snapshot() == before

    case.recipient.set_password("a-long-passphrase-of-theirs")
    case.recipient.save()
    signed_in = browser.post(
        sign_in_url.replace("&amp;", "&"),
        {"username": case.recipient.username, "password": "a-long-passphrase-of-theirs"},
    )
    assert signed_in.status_code == 302 and signed_in["Location"] == case.signed_in_path
    onward = browser.get(signed_in["Location"])
    assert onward.status_code == 302 and onward["Location"] == case.url()
    assert case.form_field in browser.get(onward["Location"]).content
    # used once: the same page again goes to the inbox
    assert browser.get(case.signed_in_path)["Location"] == case.inbox_path


@pytest.mark.django_db
def test_a_used_link_decides_nothing_again(case):
    browser = _recipient(case)
    assert browser.post(case.url(), case.valid).status_code == 200
    before = case.snapshot()

    again = browser.post(case.url(), case.valid)

    assert again.status_code == 409
    assert b"already" in again.content
    assert case.form_field not in again.content
    assert case.snapshot() == before
    shown = browser.get(case.url())
    assert shown.status_code == 200 and b"cannot be used again" in shown.content


@pytest.mark.django_db
def test_an_expired_link_decides_nothing(case):
    browser = _recipient(case)
    case.expire()
    before = case.snapshot()

    page = browser.get(case.url())
    posted = browser.post(case.url(), case.valid)

    assert page.status_code == posted.status_code == 410
    assert b"has expired" in page.content and b"has expired" in posted.content
    assert case.form_field not in page.content
    assert case.snapshot() == before
    assert case.link_row().used_at is None


@pytest.mark.django_db
def test_a_token_that_is_no_links_decides_nothing(case):
    tampered = case.token[:-1] + ("A" if case.token[-1] != "A" else "B")
    before = case.snapshot()

    for browser in (Client(), _recipient(case)):
        for bad in (tampered, case.token[:20], "x" * 300):
            page = browser.get(case.url(bad))
            assert page.status_code == 404
            assert b"This link is not valid" in page.content
            assert browser.post(case.url(bad), case.valid).status_code == 404

    assert case.snapshot() == before


@pytest.mark.django_db
@pytest.mark.parametrize(
    "garbage",
    [{}, {"answer": "\x00", "decision": "\x00", "comment": "\x00"}, {"decision": "approve" * 999}],
    ids=["empty", "nul", "long"],
)
def test_what_cannot_be_decided_is_the_form_again_not_an_error(case, garbage):
    browser = _recipient(case)
    before = case.snapshot()

    for data in (case.invalid, garbage):
        page = browser.post(case.url(), data)
        assert page.status_code == 400, data
        assert case.form_field in page.content
        assert b'role="alert"' in page.content

    assert case.invalid_says in browser.post(case.url(), case.invalid).content
    assert case.snapshot() == before
    assert case.link_row().used_at is None
    # nothing was used up: the recipient can still decide
    assert browser.post(case.url(), case.valid).status_code == 200


@pytest.mark.django_db
def test_every_kind_of_link_is_tested_here():
    """A kind registered later (docs/links.md, "Adding a kind") gets a ``Case`` here."""
    assert sorted(links.kinds()) == KINDS
