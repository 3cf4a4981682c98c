"""End to end: the documented remote agent (agentops.demo.remote_agent, written with
agentops.client) against a live server and the sandbox in non-deduplicating mode. The first
process is SIGKILLed after its refund went through but before anything was recorded; the
second gets the call as unknown, reconciles it by key, and finishes: exactly one refund."""

from __future__ import annotations

import pytest

from agentops.demo.remote_agent import MANIFEST, NAME
from runs.actors import Actor
from runs.models import Run, ToolCall, ToolReceipt
from runs.remote import agent_manifest_put
from runs.services import run_create
from tests import agentproc
from tests.api.conftest import token_for
from tests.support import event_types, refund_posts, refunds

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]


class AgentProcess(agentproc.AgentProcess):
    """The documented remote agent (``agentops.demo.remote_agent``) as a process."""

    def __init__(self, *args: str, token: str) -> None:
        super().__init__("agentops.demo.remote_agent", *args, token=token)


@pytest.fixture
def agent_token(robot, django_user_model):
    """A token of the agent's owner, a service account in the agent role."""
    admin = django_user_model.objects.create_superuser("root", password="x")
    manifest = {**MANIFEST, "owner": robot.username}
    agent_manifest_put(name=NAME, manifest=manifest, actor=Actor.for_user(admin, "cli"))
    return token_for(robot, "refunder")


def test_killed_agent_is_taken_over_and_refunds_exactly_once(
    live_server, sandbox, agent_token, operator
):
    run = run_create(
        agent_name=NAME,
        goal="refund a late order",
        input={"order_id": "ord_1002", "amount_cents": 1500},
        actor=Actor.for_user(operator, "api"),
    )
    common = ["--run", str(run.id), "--url", live_server.url, "--sandbox", sandbox.url]

    first = AgentProcess(*common, "--owner", "first", "--hold-after-tool", token=agent_token)
    try:
        key = first.wait_for("dispatching").split()[1]
        first.wait_for("tool returned succeeded", timeout=20)
    finally:
        first.kill()
    call = ToolCall.objects.get(run=run)
    assert call.status == ToolCall.Status.DISPATCHING
    assert len(refunds(sandbox)) == 1  # it happened; nothing recorded it

    second = AgentProcess(*common, "--owner", "second", token=agent_token)
    code = second.finish()
    assert code == 0, second.seen
    assert f"reconciled {key}: found" in second.seen
    assert second.seen[-1] == "finished"

    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED
    assert run.result["refund"]["idempotency_key"] == key
    call.refresh_from_db()
    assert call.status == ToolCall.Status.SUCCEEDED and call.attempt_count == 1
    assert ToolReceipt.objects.get(tool_call=call).source == "reconciliation"
    types = event_types(run.id)
    assert "tool.unknown" in types and types[-1] == "run.succeeded"
    # exactly one side effect: one refund, and the key was sent once
    assert [r["idempotency_key"] for r in refunds(sandbox)] == [key]
    assert len(refund_posts(sandbox)) == 1
