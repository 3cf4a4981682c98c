"""A remote run's conversation history (issue 27): appended under the lease, read back paged
by the agent's own account, capped per message and per run with clear codes, and kept out of
the record (no event, nothing in the hash chain)."""

from __future__ import annotations

import pytest
from django.conf import settings

from runs.models import Run, RunEvent, RunMessage
from tests.api.conftest import assert_error
from tests.support import expire_lease

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

MESSAGES = [
    {"role": "user", "content": "refund order ord_1"},
    {"role": "assistant", "tool_calls": [{"id": "call_1", "name": "refund"}]},
    {"role": "tool", "tool_call_id": "call_1", "content": {"refund_id": "rf_1"}},
]


def _append(agent, messages, **extra):
    return agent.run_post("messages", {"messages": messages, **extra})


def _read(client, run, **params):
    return client.get(f"/api/v1/runs/{run.id}/messages/", params)


def test_messages_are_appended_in_order_and_read_back(run, leased):
    events = Run.objects.get(id=run.id).event_seq

    first = _append(leased, MESSAGES[:2])
    second = _append(leased, MESSAGES[2:], after_seq=2)

    assert first.status_code == 201, first.content
    assert (first.json()["first_seq"], first.json()["last_seq"]) == (1, 2)
    assert second.status_code == 201, second.content
    assert second.json()["last_seq"] == 3
    page = _read(leased.client, run)
    assert page.status_code == 200, page.content
    assert [m["message"] for m in page.json()["results"]] == MESSAGES
    assert page.json()["last_seq"] == 3 and page.json()["next"] is None
    assert page.json()["results"][0]["written_by"].startswith("token:")
    # not the record: no event, the run's chain untouched
    assert Run.objects.get(id=run.id).event_seq == events
    assert not RunEvent.objects.filter(run_id=run.id, seq__gt=events).exists()


def test_reading_is_paged(run, leased):
    _append(leased, [{"n": i} for i in range(5)])

    first = _read(leased.client, run, limit=2).json()
    assert [m["seq"] for m in first["results"]] == [1, 2]
    assert first["next"] is not None
    rest = leased.client.get(first["next"]).json()
    assert [m["seq"] for m in rest["results"]] == [3, 4]
    last = _read(leased.client, run, after_seq=4, limit=2).json()
    assert [m["seq"] for m in last["results"]] == [5]
    assert last["next"] is None


def test_a_retried_append_is_stored_once(run, leased):
    first = _append(leased, MESSAGES, after_seq=0)

    again = _append(leased, MESSAGES, after_seq=0)

    assert again.status_code == 200, again.content
    assert again.json()["last_seq"] == first.json()["last_seq"] == 3
    assert RunMessage.objects.filter(run=run).count() == 3


def test_an_append_after_another_is_a_conflict(run, leased):
    _append(leased, MESSAGES[:1])

    body = assert_error(_append(leased, MESSAGES[1:], after_seq=0), 409, "history_conflict")

    assert body["last_seq"] == 1
    assert RunMessage.objects.filter(run=run).count() == 1


def test_a_message_over_its_limit_is_refused(run, leased, monkeypatch):
    monkeypatch.setitem(settings.AGENTOPS, "HISTORY_MAX_MESSAGE_BYTES", 100)

    answer = _append(leased, [{"ok": 1}, {"text": "x" * 200}])

    assert_error(answer, 400, "message_too_large")
    assert not RunMessage.objects.filter(run=run).exists()


def test_the_run_history_has_a_limit(run, leased, monkeypatch):
    monkeypatch.setitem(settings.AGENTOPS, "HISTORY_MAX_BYTES", 300)
    assert _append(leased, [{"text": "x" * 100}]).status_code == 201

    answer = _append(leased, [{"text": "y" * 100}, {"text": "z" * 100}])

    assert_error(answer, 409, "history_full")
    assert RunMessage.objects.filter(run=run).count() == 1


def test_appending_needs_the_lease(run, leased):
    expire_lease(run.id)

    assert_error(_append(leased, MESSAGES), 409, "lease_lost")
    assert leased.lease().status_code == 200
    leased.lease_token = "not-the-token"
    assert_error(_append(leased, MESSAGES), 403, "lease_not_yours")
    assert not RunMessage.objects.filter(run=run).exists()


def test_a_successor_reads_what_the_first_process_wrote(run, leased):
    _append(leased, MESSAGES)
    expire_lease(run.id)
    assert leased.lease().status_code == 200  # a new claim, another fence

    assert [m["message"] for m in _read(leased.client, run).json()["results"]] == MESSAGES
    assert _append(leased, [{"role": "user", "content": "again"}], after_seq=3).status_code == 201


def test_only_the_agent_account_reads_the_history(run, leased, as_operator, as_viewer):
    _append(leased, MESSAGES)

    assert_error(_read(as_operator, run), 403, "permission_denied")
    assert_error(_read(as_viewer, run), 403, "permission_denied")


@pytest.mark.parametrize(
    "body",
    [{"messages": []}, {"messages": "x"}, {"messages": [1], "after_seq": -1}],
    ids=["empty", "not-a-list", "negative-after"],
)
def test_bad_appends_are_validation_errors(run, leased, body):
    assert_error(leased.run_post("messages", body), 400, "validation_error")


def test_bad_reads_are_validation_errors(run, leased):
    assert_error(_read(leased.client, run, limit=0), 400, "validation_error")
    assert_error(_read(leased.client, run, after_seq="x"), 400, "validation_error")
