"""Questions to people by email (issue 5, item 4): each person of the question's group gets
their own single-use link (stored hashed) that expires with the question; opening it (GET)
answers nothing, only the form's POST does; the first valid answer wins, recorded with who
gave it and through which channel."""

from __future__ import annotations

import re
import threading

import pytest
from django.contrib.auth.models import Group
from django.core import mail
from django.test import Client, override_settings

from runs import outbox, sweeper
from runs.actors import Actor
from runs.links import hash_token
from runs.models import OutboxMessage, Question, QuestionLink, Run
from runs.registry import AskQuestion
from runs.services import run_create, run_terminate
from runs.waits import AlreadyAnswered, question_answer
from tests.approvals.conftest import SmtpInbox, _free_port
from tests.conftest import drive
from tests.runs.wait_support import fall_due, waits_then_finishes
from tests.support import close_connection, event_types, events

pytestmark = pytest.mark.usefixtures("roles")

LINK_PATH = re.compile(r"/questions/link/([A-Za-z0-9_-]+)/")


def link(token: str) -> str:
    return f"/questions/link/{token}/"


def token_for(address: str, outbox=None) -> str:
    """The link token in the latest message sent to ``address``."""
    messages = [m for m in (outbox if outbox is not None else mail.outbox) if address in m.to]
    assert messages, f"no email to {address}"
    match = LINK_PATH.search(messages[-1].body)
    assert match, messages[-1].body
    return match.group(1)


@pytest.fixture
def smtp_inbox():
    """A real SMTP server in a thread (aiosmtpd), as the approval email tests use."""
    from aiosmtpd.controller import Controller

    inbox = SmtpInbox()
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


@pytest.fixture
def olivia(operator):
    operator.email = "olivia@example.com"
    operator.save(update_fields=["email"])
    return operator


@pytest.fixture
def oscar(django_user_model):
    user = django_user_model.objects.create_user(
        username="oscar", password="pw-oscar", email="oscar@example.com"
    )
    user.groups.add(Group.objects.get(name="operator"))
    return user


def _onboarding(system_actor, **input) -> Run:
    """The demo agent asks the operators which plan Acme starts on (choices)."""
    run = run_create(
        agent_name="onboarding", input={"customer": "Acme", **input}, actor=system_actor
    )
    return drive(run.id)


def _asked(capture, system_actor, **input) -> tuple[Run, Question]:
    with capture(execute=True):
        run = _onboarding(system_actor, **input)
    return run, Question.objects.get(run=run)


def _recipient_client(token: str, **kwargs) -> Client:
    """A browser signed in as the link's recipient: a link answers only for them."""
    browser = Client(**kwargs)
    browser.force_login(QuestionLink.objects.get(token_hash=hash_token(token)).recipient)
    return browser


def _csrf_client(token: str) -> tuple[Client, str]:
    """The recipient's browser, signed in, having opened the link (which sets the CSRF
    cookie), as a person would."""
    browser = _recipient_client(token, enforce_csrf_checks=True)
    assert browser.get(link(token)).status_code in (200, 403, 410)
    return browser, browser.cookies["csrftoken"].value


def _text_and_html(message) -> tuple[str, str]:
    assert message.get_content_type() == "multipart/alternative"
    text = message.get_body(preferencelist=("plain",)).get_content()
    html = message.get_body(preferencelist=("html",)).get_content()
    return text, html


@pytest.mark.django_db(transaction=True)
def test_a_question_is_answered_through_its_emailed_link_over_real_smtp(
    system_actor, smtp_inbox, olivia
):
    run = _onboarding(system_actor)

    assert run.status == Run.Status.WAITING_EVENT
    question = Question.objects.get(run=run)
    assert [rcpts for _, rcpts in smtp_inbox.envelopes] == [["olivia@example.com"]]
    (message,) = smtp_inbox.messages
    assert "Which plan should Acme start on?" in message["Subject"]
    assert str(run.id)[:8] in message["Subject"]
    text, html = _text_and_html(message)
    for body in (text, html):
        assert "Which plan should Acme start on?" in body
        assert "starter, pro, enterprise" in body  # the choices
        assert str(run.id) in body
        assert question.expires_at.strftime("%Y-%m-%d %H:%M") in body
    token = LINK_PATH.search(text).group(1)
    assert LINK_PATH.search(html).group(1) == token
    assert len(token) >= 43  # 32 random bytes
    stored = QuestionLink.objects.get(question=question)
    assert stored.recipient == olivia
    assert stored.mailed_at is not None
    assert stored.token_hash == hash_token(token) and token not in stored.token_hash
    (sent,) = events(run.id, "question.email_sent")
    assert (sent.channel, sent.payload["to"]) == ("email", "olivia")

    # the link alone (a mail scanner, a forwarded email) asks for a sign-in and answers nothing
    scanner = Client(enforce_csrf_checks=True)
    asked = scanner.get(link(token))
    assert asked.status_code == 200
    assert b"Sign in to answer" in asked.content and b'name="answer"' not in asked.content
    # next= names no token: the link's path waits in the session (docs/approvals.md)
    assert b'href="/accounts/login/?next=/questions/signed-in/"' in asked.content
    csrf = scanner.cookies["csrftoken"].value
    blind = scanner.post(link(token), {"answer": "pro", "csrfmiddlewaretoken": csrf})
    assert blind.status_code == 302 and token not in blind["Location"]
    question.refresh_from_db()
    assert question.status == Question.Status.OPEN
    # signing in sends the recipient back to the link
    scanner.force_login(olivia)
    assert scanner.get("/questions/signed-in/")["Location"] == link(token)

    browser = _recipient_client(token, enforce_csrf_checks=True)
    page = browser.get(link(token))

    assert page.status_code == 200
    assert b"Which plan should Acme start on?" in page.content
    assert b'value="enterprise"' in page.content
    assert b"csrfmiddlewaretoken" in page.content
    assert page["Referrer-Policy"] == "same-origin"
    assert "no-cache" in page["Cache-Control"] or "max-age=0" in page["Cache-Control"]
    assert browser.head(link(token)).status_code == 200
    question.refresh_from_db()
    assert question.status == Question.Status.OPEN
    assert "question.answered" not in event_types(run.id)

    refused = browser.post(link(token), {"answer": "pro"})  # no CSRF token
    assert refused.status_code == 403
    question.refresh_from_db()
    assert question.status == Question.Status.OPEN

    csrf = browser.cookies["csrftoken"].value
    wrong = browser.post(link(token), {"answer": "platinum", "csrfmiddlewaretoken": csrf})
    assert wrong.status_code == 400
    assert b"must be one of" in wrong.content
    stored.refresh_from_db()
    assert stored.used_at is None  # a refused answer does not use the link up

    answered = browser.post(link(token), {"answer": "pro", "csrfmiddlewaretoken": csrf})

    assert answered.status_code == 200
    assert b"has been answered" in answered.content
    question.refresh_from_db()
    assert (question.status, question.answer, question.channel) == ("answered", "pro", "email")
    assert question.answered_by == olivia
    (used,) = events(run.id, "question.link_used")
    (answer,) = events(run.id, "question.answered")
    assert (used.actor, used.channel) == ("user:olivia", "email")
    assert (answer.actor, answer.channel) == ("user:olivia", "email")
    assert used.seq < answer.seq
    assert Run.objects.get(id=run.id).status == Run.Status.QUEUED  # the wait can end now

    run = drive(run.id)
    assert run.state["plan"] == "pro"
    (ended,) = events(run.id, "run.wait_ended")
    assert (ended.payload["answered_by"], ended.payload["channel"]) == ("olivia", "email")

    again = browser.get(link(token))
    assert again.status_code == 200
    assert b"olivia" in again.content and b"via email" in again.content
    assert b"cannot be used again" in again.content
    assert b'name="answer"' not in again.content
    second = browser.post(link(token), {"answer": "enterprise", "csrfmiddlewaretoken": csrf})
    assert second.status_code == 409
    question.refresh_from_db()
    assert question.answer == "pro"
    assert len(events(run.id, "question.answered")) == 1


@pytest.mark.django_db
def test_every_member_of_the_group_with_an_address_gets_their_own_link(
    django_capture_on_commit_callbacks, system_actor, olivia, oscar, django_user_model
):
    no_address = django_user_model.objects.create_user(username="nadia", password="pw")
    no_address.groups.add(Group.objects.get(name="operator"))
    gone = django_user_model.objects.create_user(
        username="gus", password="pw", email="gus@example.com", is_active=False
    )
    gone.groups.add(Group.objects.get(name="operator"))
    outsider = django_user_model.objects.create_user(
        username="ann", password="pw", email="ann@example.com"
    )
    outsider.groups.add(Group.objects.get(name="approver"))  # asked of operators only

    run, question = _asked(django_capture_on_commit_callbacks, system_actor)

    assert sorted(m.to[0] for m in mail.outbox) == ["olivia@example.com", "oscar@example.com"]
    tokens = {LINK_PATH.search(m.body).group(1) for m in mail.outbox}
    assert len(tokens) == 2
    links = QuestionLink.objects.filter(question=question)
    assert {row.recipient.username for row in links} == {"olivia", "oscar"}
    assert {row.token_hash for row in links} == {hash_token(t) for t in tokens}
    assert all(m.alternatives[0][1] == "text/html" for m in mail.outbox)
    assert len(events(run.id, "question.email_sent")) == 2


@pytest.mark.django_db
def test_no_email_is_sent_before_the_question_commits(system_actor, olivia):
    # the commit callbacks never run: the test's transaction never commits
    run = _onboarding(system_actor)

    assert run.status == Run.Status.WAITING_EVENT
    assert mail.outbox == []
    assert QuestionLink.objects.filter(question__run=run).count() == 1  # made, not sent
    assert "question.email_sent" not in event_types(run.id)


@pytest.mark.django_db
def test_a_free_text_question_is_answered_by_link_and_an_empty_answer_is_refused(
    django_capture_on_commit_callbacks, register, system_actor, olivia
):
    register(
        waits_then_finishes(
            "asks_why", AskQuestion(text="Why was order 1003 refunded twice?", ttl_seconds=600)
        )
    )
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(run_create(agent_name="asks_why", actor=system_actor).id)
    token = token_for("olivia@example.com")
    assert "free text" in mail.outbox[0].body
    browser, csrf = _csrf_client(token)
    page = browser.get(link(token))
    assert b"<textarea" in page.content

    empty = browser.post(link(token), {"answer": "   ", "csrfmiddlewaretoken": csrf})
    assert empty.status_code == 400
    assert b"write an answer" in empty.content
    answered = browser.post(
        link(token), {"answer": "  A retry after a timeout.  ", "csrfmiddlewaretoken": csrf}
    )

    assert answered.status_code == 200
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert run.result["outputs"] == ["A retry after a timeout."]


@pytest.mark.django_db
def test_the_first_answer_wins_and_the_other_links_then_answer_nothing(
    django_capture_on_commit_callbacks, system_actor, olivia, oscar
):
    run, question = _asked(django_capture_on_commit_callbacks, system_actor)
    oscars_token = token_for("oscar@example.com")
    browser, csrf = _csrf_client(oscars_token)

    question_answer(
        question_id=question.id, answer="enterprise", actor=Actor.for_user(olivia, "web")
    )
    page = browser.get(link(oscars_token))
    late = browser.post(link(oscars_token), {"answer": "pro", "csrfmiddlewaretoken": csrf})

    assert page.status_code == 200
    assert b"has been answered" in page.content
    assert b"olivia" in page.content and b"via web" in page.content
    assert b'name="answer"' not in page.content
    assert late.status_code == 409
    assert b"already answered by olivia" in late.content
    question.refresh_from_db()
    assert (question.answer, question.answered_by, question.channel) == (
        "enterprise",
        olivia,
        "web",
    )
    assert QuestionLink.objects.get(question=question, recipient=oscar).used_at is None
    assert "question.link_used" not in event_types(run.id)


@pytest.mark.django_db
def test_a_link_expires_with_its_question_and_the_agent_gets_the_default(
    django_capture_on_commit_callbacks, system_actor, olivia
):
    run, question = _asked(django_capture_on_commit_callbacks, system_actor)
    token = token_for("olivia@example.com")
    browser, csrf = _csrf_client(token)

    fall_due(run.id)
    page = browser.get(link(token))
    late = browser.post(link(token), {"answer": "pro", "csrfmiddlewaretoken": csrf})

    assert page.status_code == 410
    assert b"has expired" in page.content
    assert b'name="answer"' not in page.content
    assert late.status_code == 410
    question.refresh_from_db()
    assert question.status == Question.Status.OPEN  # the engine records the expiry ...
    run = drive(run.id)
    question.refresh_from_db()
    assert question.status == Question.Status.EXPIRED  # ... when it wakes the run
    assert run.state["plan"] == "starter"
    assert browser.get(link(token)).status_code == 410
    assert QuestionLink.objects.get(question=question).used_at is None


@pytest.mark.django_db
def test_a_link_to_a_question_of_a_terminated_run_answers_nothing(
    django_capture_on_commit_callbacks, system_actor, olivia
):
    run, question = _asked(django_capture_on_commit_callbacks, system_actor)
    token = token_for("olivia@example.com")
    browser, csrf = _csrf_client(token)

    run_terminate(run_id=run.id, actor=system_actor, reason="customer withdrew")
    page = browser.get(link(token))
    late = browser.post(link(token), {"answer": "pro", "csrfmiddlewaretoken": csrf})

    assert page.status_code == 410
    assert b"withdrawn" in page.content
    assert late.status_code == 410
    question.refresh_from_db()
    assert question.status == Question.Status.CANCELLED


@pytest.mark.django_db
def test_a_recipient_who_left_the_group_can_no_longer_answer(
    django_capture_on_commit_callbacks, system_actor, olivia
):
    run, question = _asked(django_capture_on_commit_callbacks, system_actor)
    token = token_for("olivia@example.com")
    browser, csrf = _csrf_client(token)

    olivia.groups.remove(Group.objects.get(name="operator"))
    page = browser.get(link(token))
    posted = browser.post(link(token), {"answer": "pro", "csrfmiddlewaretoken": csrf})

    assert page.status_code == posted.status_code == 403
    assert b"cannot answer" in page.content
    question.refresh_from_db()
    assert question.status == Question.Status.OPEN
    assert QuestionLink.objects.get(question=question).used_at is None
    assert "question.link_used" not in event_types(run.id)


@pytest.mark.django_db
def test_a_failing_mail_server_is_recorded_retried_and_the_question_stays_answerable(
    django_capture_on_commit_callbacks, system_actor, olivia, settings
):
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", 9, 2

    run, question = _asked(django_capture_on_commit_callbacks, system_actor)

    assert run.status == Run.Status.WAITING_EVENT
    (failed,) = events(run.id, "question.email_failed")
    assert failed.payload["to"] == "olivia" and failed.payload["error"]
    (row,) = OutboxMessage.objects.filter(kind="question")
    assert (row.status, row.attempts) == ("pending", 1) and row.next_attempt_at is not None
    # not due again at once: the backoff
    assert outbox.outbox_drain_due() == 0
    question_answer(question_id=question.id, answer="pro", actor=Actor.for_user(olivia, "web"))
    assert drive(run.id).state["plan"] == "pro"
    # its turn comes after the question was answered: nothing left to ask
    OutboxMessage.objects.update(next_attempt_at=None)
    assert outbox.outbox_drain_due() == 0
    assert OutboxMessage.objects.get().status == "cancelled"


@pytest.mark.django_db
def test_emails_a_killed_process_never_sent_are_sent_by_the_sweeper(
    django_capture_on_commit_callbacks, system_actor, olivia, oscar
):
    # the asking commit happened, its after-commit sending never ran (the process died)
    run = _onboarding(system_actor)
    question = Question.objects.get(run=run)
    links = list(QuestionLink.objects.filter(question=question))
    assert len(links) == 2 and all(row.mailed_at is None for row in links)
    assert mail.outbox == []

    sweeper.sweep()  # the outbox's hook is registered with the sweeper

    asked = [m for m in mail.outbox if m.subject.startswith("Question from run")]
    assert sorted(m.to[0] for m in asked) == ["olivia@example.com", "oscar@example.com"]
    assert all(row.mailed_at is not None for row in QuestionLink.objects.filter(question=question))
    sent = events(run.id, "question.email_sent")
    assert sorted(e.payload["to"] for e in sent) == ["olivia", "oscar"]
    browser, csrf = _csrf_client(token_for("olivia@example.com"))
    answered = browser.post(
        link(token_for("olivia@example.com")), {"answer": "pro", "csrfmiddlewaretoken": csrf}
    )
    assert answered.status_code == 200
    question.refresh_from_db()
    assert (question.answer, question.channel) == ("pro", "email")

    sweeper.sweep()  # sent once, not again
    assert len([m for m in mail.outbox if m.subject.startswith("Question from run")]) == 2


@pytest.mark.django_db
def test_no_email_is_sent_for_a_question_that_is_no_longer_open(system_actor, olivia):
    run = _onboarding(system_actor)  # its emails never went out
    question = Question.objects.get(run=run)
    question_answer(question_id=question.id, answer="pro", actor=Actor.for_user(olivia, "web"))

    assert outbox.outbox_drain_due() == 0

    assert mail.outbox == []
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {"cancelled"}


@pytest.mark.django_db(transaction=True)
def test_the_same_link_used_twice_at_once_answers_once(system_actor, olivia, oscar, settings):
    """olivia's link is submitted twice at the same moment (a double click, a retried
    request) while oscar answers on the web page: exactly one answer is recorded."""
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    run = _onboarding(system_actor)  # committed: the emails went out
    question = Question.objects.get(run=run)
    token = token_for("olivia@example.com")
    barrier = threading.Barrier(3)
    outcomes: dict[str, str] = {}

    def by_link(name: str, answer: str) -> None:
        try:
            barrier.wait()
            response = _recipient_client(token).post(link(token), {"answer": answer})
            outcomes[name] = "won" if response.status_code == 200 else str(response.status_code)
        finally:
            close_connection()

    def by_page() -> None:
        try:
            barrier.wait()
            question_answer(
                question_id=question.id, answer="starter", actor=Actor.for_user(oscar, "web")
            )
            outcomes["page"] = "won"
        except AlreadyAnswered:
            outcomes["page"] = "already_answered"
        finally:
            close_connection()

    threads = [
        threading.Thread(target=by_link, args=("link-1", "pro")),
        threading.Thread(target=by_link, args=("link-2", "enterprise")),
        threading.Thread(target=by_page),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert list(outcomes.values()).count("won") == 1, outcomes
    question.refresh_from_db()
    winner = next(name for name, outcome in outcomes.items() if outcome == "won")
    expected = {"link-1": "pro", "link-2": "enterprise", "page": "starter"}[winner]
    assert question.answer == expected
    assert len(events(run.id, "question.answered")) == 1
    assert len(events(run.id, "question.link_used")) == (0 if winner == "page" else 1)
    used = QuestionLink.objects.get(question=question, recipient=olivia).used_at
    assert (used is not None) == (winner != "page")
