"""Long polls (issue 27): ``?wait=N`` on the run a remote agent waits on (approval, durable wait)
and on an approval holds the answer until the status changes or N seconds passed — re-reading
one row with backoff, in autocommit, at most a few per token at once."""

from __future__ import annotations

import threading
import time

import pytest
from django.conf import settings
from django.db import connection

from approvals.models import Approval
from approvals.services import approval_decide
from runs.actors import Actor
from runs.api import longpoll
from runs.models import Run
from runs.waits import run_signal
from tests.api.conftest import assert_error, client_for

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

BIG_REFUND = {"order_id": "ord_1", "amount_cents": 50000}


@pytest.fixture
def awaiting(run, leased) -> Approval:
    proposal = leased.propose("refund", BIG_REFUND)
    assert proposal.json()["decision"] == "awaiting_approval", proposal.content
    return Approval.objects.get(id=proposal.json()["approval"])


def _during_the_hold(monkeypatch, change) -> list[float]:
    """``change()`` happens while the request is held (at its first pause); the pauses are
    recorded, not slept."""
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        if not pauses:
            change()
        pauses.append(seconds)

    monkeypatch.setattr(longpoll, "sleep", pause)
    return pauses


def _approve(approval: Approval, approver) -> None:
    approval_decide(
        approval_id=approval.id, decision="approve", actor=Actor.for_user(approver, "api")
    )


def test_the_agent_long_polls_its_run_until_the_approval_is_decided(
    run, leased, awaiting, approver, monkeypatch
):
    pauses = _during_the_hold(monkeypatch, lambda: _approve(awaiting, approver))

    answer = leased.client.get(f"/api/v1/runs/{run.id}/", {"wait": 30})

    assert answer.status_code == 200, answer.content
    assert answer[longpoll.HEADER] == "changed"
    assert answer.json()["status"] == "queued"  # lease it and dispatch the approved call
    assert pauses == [longpoll.FIRST_DELAY]


def test_the_agent_long_polls_its_run_until_its_wait_ends(run, leased, operator, monkeypatch):
    wait = leased.run_post("waits", {"kind": "signal", "name": "replied"})
    assert wait.json()["waiting"] is True, wait.content
    signal = lambda: run_signal(  # noqa: E731
        run_id=run.id, name="replied", payload={"ok": 1}, actor=Actor.for_user(operator, "api")
    )
    _during_the_hold(monkeypatch, signal)

    answer = leased.client.get(f"/api/v1/runs/{run.id}/", {"wait": 30})

    assert answer[longpoll.HEADER] == "changed"
    assert answer.json()["status"] == "queued"


def test_an_approver_long_polls_the_approval(awaiting, approver, as_approver, monkeypatch):
    _during_the_hold(monkeypatch, lambda: _approve(awaiting, approver))

    answer = as_approver.get(f"/api/v1/approvals/{awaiting.id}/", {"wait": 10})

    assert answer.status_code == 200, answer.content
    assert answer[longpoll.HEADER] == "changed"
    assert answer.json()["status"] == "approved"


def test_nothing_changes_it_answers_after_the_wait_with_backoff(run, leased, awaiting, monkeypatch):
    slept: list[float] = []

    def pause(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(longpoll, "sleep", pause)
    started = time.monotonic()

    answer = leased.client.get(f"/api/v1/runs/{run.id}/", {"wait": 2})

    assert 1.9 <= time.monotonic() - started < 4
    assert answer[longpoll.HEADER] == "timeout"
    assert answer.json()["status"] == "waiting_approval"
    # 0.1, 0.2, 0.4, 0.8, then what is left: a handful of reads, not a busy loop
    assert slept[:4] == [0.1, 0.2, 0.4, 0.8]
    assert len(slept) <= 6 and max(slept) <= longpoll.MAX_DELAY


def test_a_run_not_parked_is_answered_at_once(run, leased, monkeypatch):
    monkeypatch.setattr(longpoll, "sleep", lambda seconds: pytest.fail("held"))

    answer = leased.client.get(f"/api/v1/runs/{run.id}/", {"wait": 30})

    assert answer[longpoll.HEADER] == "none"
    assert answer.json()["status"] == "running"


def test_without_wait_nothing_is_held(run, leased, awaiting, monkeypatch):
    monkeypatch.setattr(longpoll, "sleep", lambda seconds: pytest.fail("held"))

    assert leased.client.get(f"/api/v1/runs/{run.id}/")[longpoll.HEADER] == "none"


def test_past_the_per_token_cap_it_is_answered_at_once(run, leased, awaiting, monkeypatch):
    monkeypatch.setitem(settings.AGENTOPS, "LONG_POLLS_PER_TOKEN", 0)
    monkeypatch.setattr(longpoll, "sleep", lambda seconds: pytest.fail("held"))

    answer = leased.client.get(f"/api/v1/runs/{run.id}/", {"wait": 30})

    assert answer.status_code == 200
    assert answer[longpoll.HEADER] == "capped"


def test_past_the_per_process_cap_it_is_refused_with_when_to_come_back(
    run, leased, awaiting, monkeypatch
):
    """Other tokens' long polls fill the process: this one is refused at once, 429 with
    ``retry_after`` (field and header), and holds nothing; the count goes back down."""
    monkeypatch.setitem(settings.AGENTOPS, "LONG_POLLS_PER_PROCESS", 1)
    monkeypatch.setattr(longpoll, "sleep", lambda seconds: pytest.fail("held"))
    with longpoll._slot(("token", "someone else")) as granted:
        assert granted
        answer = leased.client.get(f"/api/v1/runs/{run.id}/", {"wait": 30})
        body = assert_error(answer, 429, "long_polls_busy")
        assert body["retry_after"] == longpoll.BUSY_RETRY_AFTER
        assert int(answer["Retry-After"]) >= longpoll.BUSY_RETRY_AFTER
        # a read without wait holds nothing, and is answered as ever
        assert leased.client.get(f"/api/v1/runs/{run.id}/").status_code == 200
    assert not longpoll._held


@pytest.mark.parametrize("wait", ["31", "-1", "x", "", "1.5"])
def test_a_bad_wait_is_a_validation_error(run, leased, awaiting, as_approver, wait):
    for path in (f"/api/v1/runs/{run.id}/", f"/api/v1/approvals/{awaiting.id}/"):
        client = leased.client if "runs" in path else as_approver
        body = assert_error(client.get(path, {"wait": wait}), 400, "validation_error")
        assert "wait" in body["fields"]


def test_another_agents_run_is_not_found_even_with_wait(run, admin, awaiting, django_user_model):
    from django.contrib.auth.models import Group

    stranger = django_user_model.objects.create_user("other-bot")
    stranger.groups.add(Group.objects.get(name="agent"))

    answer = client_for(stranger).get(f"/api/v1/runs/{run.id}/", {"wait": 5})

    assert_error(answer, 404, "not_found")


@pytest.mark.django_db(transaction=True)
def test_a_real_hold_ends_when_another_request_decides(run, leased, approver, as_approver):
    """Two threads, two connections: the hold sees a commit made while it waits."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's test database is not shared between threads here")
    approval = Approval.objects.get(id=leased.propose("refund", BIG_REFUND).json()["approval"])

    def decide_soon() -> None:
        try:
            time.sleep(0.5)
            as_approver.post(f"/api/v1/approvals/{approval.id}/decision/", {"decision": "approve"})
        finally:
            connection.close()

    thread = threading.Thread(target=decide_soon)
    started = time.monotonic()
    thread.start()
    answer = leased.client.get(f"/api/v1/runs/{run.id}/", {"wait": 20})
    thread.join(timeout=10)

    assert answer[longpoll.HEADER] == "changed"
    assert answer.json()["status"] == Run.Status.QUEUED
    assert time.monotonic() - started < 5
