"""A remote agent under a spend cap (issue 26 item 3, docs/agents.md "Spend caps"): the usage
its steps report counts in the run's scopes, a step of a run whose scope is used up is
refused and stops the run, and a dispatch of a call that declares a cost is reserved and
checked like a hosted one."""

from __future__ import annotations

from typing import Any

import pytest

from runs import spend
from runs.actors import Actor
from runs.models import Run, SpendCounter
from tests.api.conftest import assert_error
from tests.api.remote.test_flow_limits import _agent
from tests.api.remote_support import register_remote, remote_run

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

MANIFEST: dict[str, Any] = {
    "version": "1",
    "tools": [{"name": "charge", "effect": "idempotent", "timeout": 1}],
}


def test_reported_usage_counts_and_a_full_scope_stops_the_run_until_a_top_up(
    admin, operator, robot
):
    register_remote(admin, "cap_bot", MANIFEST, owner=robot)
    olivia = Actor.for_user(operator, "web")
    spend.spend_cap_set(scope="agent", subject="cap_bot", max_cost="1", actor=olivia)
    run = remote_run(operator, "cap_bot")
    agent = _agent(robot, run, "proc-1")

    for _ in range(2):
        answer = agent.run_post("steps", {"input": {}, "output": {}, "cost": "0.6"})
        assert answer.status_code == 201, answer.content
    counter = SpendCounter.objects.get(scope="agent", subject="cap_bot")
    assert str(counter.cost_used) == "1.200000"

    refused = agent.run_post("steps", {"input": {}, "output": {}, "cost": "0.1"})
    body = assert_error(refused, 409, "budget_exhausted")
    assert "spend cap reached: agent cap_bot" in body["detail"]
    run.refresh_from_db()
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")

    topped = spend.spend_top_up(scope="agent", subject="cap_bot", add_cost="1", actor=olivia)
    assert topped.resumed == 1
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    again = _agent(robot, run, "proc-2")
    assert again.run_post("steps", {"input": {}, "output": {}, "cost": "0.1"}).status_code == 201


def test_a_remote_dispatch_in_a_used_up_scope_is_not_sent(admin, operator, robot):
    register_remote(admin, "cap_bot", MANIFEST, owner=robot)
    olivia = Actor.for_user(operator, "web")
    run = remote_run(operator, "cap_bot")
    agent = _agent(robot, run, "proc-1")
    call = agent.propose("charge", {"n": 1}).json()["tool_call"]
    spend.spend_cap_set(scope="global_day", max_tokens=0, actor=olivia)
    answer = agent.dispatch(call["id"])

    assert answer.status_code == 200, answer.content
    assert answer.json()["go"] is False
    assert "spend cap reached: all runs per day" in answer.json()["reason"]
    run.refresh_from_db()
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")
