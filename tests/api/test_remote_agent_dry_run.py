"""End to end: a dry run of the documented remote agent (agentops.demo.remote_agent, written
with agentops.client) against a live server and the sandbox: the client is told not to
execute, simulates the refund, and nothing reaches the sandbox's ledger."""

from __future__ import annotations

import pytest

from agentops.demo.remote_agent import NAME
from runs.actors import Actor
from runs.models import Run, ToolCall, ToolReceipt
from runs.services import run_create
from tests.api.test_remote_agent_e2e import AgentProcess, agent_token  # noqa: F401
from tests.support import refund_posts, refunds

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]


def test_a_dry_run_of_the_remote_refund_agent_sends_nothing(
    live_server,
    sandbox,
    agent_token,  # noqa: F811
    operator,
):
    run = run_create(
        agent_name=NAME,
        input={"order_id": "ord_1002", "amount_cents": 1500},
        actor=Actor.for_user(operator, "api"),
        dry_run=True,
    )
    common = ["--run", str(run.id), "--url", live_server.url, "--sandbox", sandbox.url]

    agent = AgentProcess(*common, "--owner", "dry", token=agent_token)

    assert agent.finish() == 0, agent.seen
    assert agent.seen[0].endswith("(a dry run)")
    assert "dry run: would refund 1500 to ord_1002" in agent.seen
    assert not any(line.startswith("dispatching") for line in agent.seen)
    assert refund_posts(sandbox) == [] and refunds(sandbox) == []
    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED
    assert run.result["refund"]["dry_run"] is True
    call = ToolCall.objects.get(run=run)
    assert ToolReceipt.objects.get(tool_call=call).source == ToolReceipt.Source.SIMULATED
