"""What a process taking over a remote run reads in its resume packet (issue 27): the seq of
its next step, and an open call's send deadline and the time after which a lookup may
report it absent — in fields, not in an error's prose."""

from __future__ import annotations

import pytest
from django.utils.dateparse import parse_datetime

from runs.models import ToolCall
from tests.api.remote_support import Agent
from tests.support import expire_lease

pytestmark = pytest.mark.django_db


def test_the_resume_packet_names_the_next_seq_and_the_open_calls_deadlines(run, leased, as_robot):
    assert leased.resume["next_seq"] == 1
    proposed = leased.propose("refund", {"order_id": "ord_1", "amount_cents": 500})
    call_id = proposed.json()["tool_call"]["id"]
    assert leased.dispatch(call_id).status_code == 200
    # the process dies after dispatching; another takes the run over
    expire_lease(run.id)
    successor = Agent(as_robot, run.id)
    assert successor.lease(owner="proc-2").status_code == 200, successor.resume

    call = ToolCall.objects.get(id=call_id)
    assert successor.resume["next_seq"] == 2
    (open_call,) = successor.resume["open_tool_calls"]
    assert open_call["id"] == call_id
    assert parse_datetime(open_call["send_deadline"]) == call.send_deadline
    assert parse_datetime(open_call["resend_after"]) == call.landing_deadline


def test_a_call_not_dispatched_has_no_deadlines(run, leased, as_robot):
    leased.propose("refund", {"order_id": "ord_1", "amount_cents": 500})
    expire_lease(run.id)
    successor = Agent(as_robot, run.id)
    assert successor.lease(owner="proc-2").status_code == 200
    (open_call,) = successor.resume["open_tool_calls"]
    assert open_call["status"] == "proposed"
    assert open_call["send_deadline"] is None and open_call["resend_after"] is None
    assert successor.resume["next_seq"] == 2
