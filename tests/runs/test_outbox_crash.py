"""The outbox against real worker processes and a real SMTP server (DESIGN §9): a worker
killed at each notify point, and the approver still receives the approval email, with a
link that works, within 30 seconds of a worker being alive again."""

from __future__ import annotations

import time

import pytest
from django.test import Client

from agentops.demo.smtpsink import SmtpSink
from approvals.models import Approval
from runs.models import OutboxMessage, Run
from runs.services import run_create
from tests.runs.workerprocs import wait_for, worker_env

LARGE = {"order_id": "ord_1004", "amount_cents": 20_000}  # above the approval threshold
ADDRESS = "alice@example.com"
# a claim that a test can outlast, and a send that fits in it
OUTBOX = {"AGENTOPS_OUTBOX_CLAIM_SECONDS": "3", "AGENTOPS_OUTBOX_SEND_TIMEOUT": "1"}


@pytest.fixture
def sink():
    server = SmtpSink()
    server.start()
    yield server
    server.stop()


def _env(sandbox, sink, **extra):
    return worker_env(
        sandbox,
        EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend",
        EMAIL_HOST="127.0.0.1",
        EMAIL_PORT=str(sink.port),
        **OUTBOX,
        **extra,
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("roles")
@pytest.mark.parametrize("boundary", ["notify_enqueued", "notify_sent"])
def test_a_worker_killed_at_a_notify_point_loses_no_approval_email(
    boundary, worker_procs, sandbox, sink, system_actor, approver
):
    approver.email = ADDRESS
    approver.save(update_fields=["email"])
    run = run_create(agent_name="refund", input=LARGE, actor=system_actor)

    crashing = worker_procs.start("crash-1", _env(sandbox, sink, AGENTOPS_CRASH_AT=boundary))
    assert crashing.wait_exit(30) == -9, crashing.output()
    assert f"killing process group at {boundary}" in crashing.output()
    approval = Approval.objects.get(run=run)
    (row,) = OutboxMessage.objects.filter(kind="approval.request")
    assert row.status == "pending"  # sent or not, never marked
    before = len(sink.about_approval(approval.id, ADDRESS))
    assert before == (1 if boundary == "notify_sent" else 0)

    worker_procs.start("crash-1", _env(sandbox, sink))  # alive again
    emails = wait_for(
        lambda: (
            len(sink.about_approval(approval.id, ADDRESS)) > before
            and sink.about_approval(approval.id, ADDRESS)
        ),
        30,
        what="the approval email after the restart",
    )
    wait_for(lambda: OutboxMessage.objects.get(id=row.id).status == "sent", 10, what="the mark")
    # a copy after "sent, never marked" is the same message with the same link
    assert {m.message_id for m in emails} == {row.message_id}
    assert len({m.approval_link_path for m in emails}) == 1

    browser = Client()
    browser.force_login(approver)
    path = emails[-1].approval_link_path
    assert b'name="decision"' in browser.get(path).content
    decided = browser.post(path, {"decision": "approve", "confirm": "yes"})
    assert decided.status_code == 200
    assert Approval.objects.get(id=approval.id).status == Approval.Status.APPROVED
    wait_for(
        lambda: Run.objects.get(id=run.id).status == Run.Status.SUCCEEDED,
        30,
        what="the run to finish",
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("roles")
def test_a_drainer_paused_after_its_claim_sends_nothing_once_taken_over(
    worker_procs, sandbox, sink, system_actor, approver
):
    approver.email = ADDRESS
    approver.save(update_fields=["email"])
    run = run_create(agent_name="refund", input=LARGE, actor=system_actor)

    paused = worker_procs.start("pause-a", _env(sandbox, sink, AGENTOPS_PAUSE_AT="notify_claimed"))
    wait_for(
        lambda: paused.frozen() and "freezing process group at notify_claimed" in paused.output(),
        30,
        what="worker A to freeze after claiming the email",
    )
    approval = Approval.objects.get(run=run)
    assert sink.about_approval(approval.id, ADDRESS) == []

    worker_procs.start("pause-b", _env(sandbox, sink))  # takes it over once A's claim ran out
    wait_for(lambda: sink.about_approval(approval.id, ADDRESS), 30, what="B to send the email")
    paused.resume()
    wait_for(
        lambda: OutboxMessage.objects.get(kind="approval.request").status == "sent",
        10,
        what="the mark",
    )
    time.sleep(1.5)  # whatever A would still send has arrived by now
    assert len(sink.about_approval(approval.id, ADDRESS)) == 1
