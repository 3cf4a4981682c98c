"""A remote agent's dispatch obeys its tool's limit (issue 26, docs/remote-agents.md): over it,
nothing is dispatched and the agent is told when to try again (429 ``at_capacity`` with
``retry_after``); the slot frees at the receipt."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from runs.models import ToolCall, ToolLimit, ToolWaiter
from tests.api.conftest import assert_error, token_for
from tests.api.remote_support import Agent, register_remote, remote_run

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

MANIFEST: dict[str, Any] = {
    "version": "1",
    "tools": [{"name": "charge", "effect": "idempotent", "timeout": 1}],
}


def _agent(robot, run, name: str) -> Agent:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(robot, name)}")
    agent = Agent(client, run.id)
    assert agent.lease().status_code == 200
    return agent


def test_a_remote_dispatch_over_the_limit_is_told_to_retry_later(admin, operator, robot):
    register_remote(admin, "flow_bot", MANIFEST, owner=robot)
    ToolLimit.objects.create(tool_name="flow_bot/charge", max_in_flight=1)
    first = _agent(robot, remote_run(operator, "flow_bot"), "proc-1")
    second = _agent(robot, remote_run(operator, "flow_bot"), "proc-2")

    one = first.propose("charge", {"n": 1}).json()["tool_call"]
    assert first.dispatch(one["id"]).json()["go"] is True
    two = second.propose("charge", {"n": 2}).json()["tool_call"]
    body = assert_error(second.dispatch(two["id"]), 429, "at_capacity")
    assert body["tool"] == "flow_bot/charge" and 0 < body["retry_after"] <= 10
    assert ToolCall.objects.get(id=two["id"]).status == ToolCall.Status.PROPOSED

    assert first.receipt(one["id"], outcome="succeeded", result={"ok": 1}).status_code == 200
    assert second.dispatch(two["id"]).json()["go"] is True


def test_a_manifest_declares_a_tools_limit_and_bad_limits_are_refused(admin, operator, robot):
    declared = {
        "version": "1",
        "tools": [
            {"name": "charge", "effect": "idempotent", "timeout": 1,
             "limits": {"max_in_flight": 1, "key_argument": "merchant"}},
        ],
    }  # fmt: skip
    register_remote(admin, "declared_bot", declared, owner=robot)
    first = _agent(robot, remote_run(operator, "declared_bot"), "proc-1")
    second = _agent(robot, remote_run(operator, "declared_bot"), "proc-2")
    one = first.propose("charge", {"merchant": "m1"}).json()["tool_call"]
    assert first.dispatch(one["id"]).json()["go"] is True
    other = second.propose("charge", {"merchant": "m2"}).json()["tool_call"]
    assert second.dispatch(other["id"]).json()["go"] is True  # another merchant's limit

    admin_client = APIClient()
    admin_client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(admin, 'admin-put')}")
    for bad in ({"max_in_flight": 0}, {"rate": "fast"}, {"per_minute": 3}, [1]):
        body = {"version": "2", "tools": [{"name": "charge", "effect": "idempotent",
                                           "limits": bad}]}  # fmt: skip
        answer = admin_client.put("/api/v1/agents/declared_bot/", body, format="json")
        assert_error(answer, 400, "validation_error")


def test_remote_agents_over_the_limit_wait_in_the_fair_line(admin, operator, robot):
    """A remote dispatch told to retry later keeps its place in line (issue 26): when the
    slot frees, the agent that came first gets it, not whichever retries first."""
    register_remote(admin, "line_bot", MANIFEST, owner=robot)
    ToolLimit.objects.create(tool_name="line_bot/charge", max_in_flight=1)
    agents = [_agent(robot, remote_run(operator, "line_bot"), f"proc-{n}") for n in range(3)]
    calls = [a.propose("charge", {"n": n}).json()["tool_call"] for n, a in enumerate(agents)]
    assert agents[0].dispatch(calls[0]["id"]).json()["go"] is True
    assert_error(agents[1].dispatch(calls[1]["id"]), 429, "at_capacity")
    assert_error(agents[2].dispatch(calls[2]["id"]), 429, "at_capacity")
    assert ToolWaiter.objects.count() == 2

    assert agents[0].receipt(calls[0]["id"], outcome="succeeded", result={}).status_code == 200
    # the third retries first, but the second waited longer: the slot is kept for it
    body = assert_error(agents[2].dispatch(calls[2]["id"]), 429, "at_capacity")
    assert body["retry_after"] <= 1
    assert agents[1].dispatch(calls[1]["id"]).json()["go"] is True
    assert [str(r) for r in ToolWaiter.objects.values_list("run_id", flat=True)] == [
        agents[2].run_id
    ]
