"""A remote agent's manifest tool called through the MCP gateway: the MCP SDK's own client
against a live ``runmcp`` process; the remote agent (``agentops.demo.mcp_refunder``, written
with ``agentops.client``) as a process of its own against the live API, refunding through
the sandbox in its non-deduplicating mode. No worker runs: nothing here is the workers'."""

from __future__ import annotations

import threading

import pytest
from django.test import Client as DjangoClient
from django.urls import reverse

from agentops.demo.mcp_refunder import MANIFEST, NAME
from agentops.mcp.models import GatewayCall
from approvals.models import Approval
from runs.actors import Actor
from runs.models import Run, ToolCall, ToolReceipt
from runs.remote import agent_manifest_put
from tests import agentproc
from tests.mcp.conftest import call, call_until_final, run_client, token_of
from tests.runs.workerprocs import worker_env
from tests.support import event_types, refund_posts, refunds

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.usefixtures("roles"),
]

TOOL = f"{NAME}/refund_payment"
SMALL = {"order_id": "ord_1002", "amount_cents": 700}
LARGE = {"order_id": "ord_1004", "amount_cents": 20_000}  # above the approval threshold


@pytest.fixture
def refunders(robot, django_user_model, live_server, sandbox):
    """The remote agent's manifest (owned by ``robot``); ``start()`` starts a process of
    it, serving; all are killed at the end."""
    admin = django_user_model.objects.create_superuser("root", password="x")
    agent_manifest_put(
        name=NAME,
        manifest={**MANIFEST, "owner": robot.username},
        actor=Actor.for_user(admin, "cli"),
    )
    token = token_of(robot, "mcp-refunder")
    started: list[agentproc.AgentProcess] = []

    class Starter:
        def start(self, *args: str) -> agentproc.AgentProcess:
            process = agentproc.AgentProcess(
                "agentops.demo.mcp_refunder",
                *("--url", live_server.url, "--sandbox", sandbox.url, "--poll", "0.2", *args),
                token=token,
            )
            started.append(process)
            process.wait_for("serving", timeout=30)
            return process

    yield Starter()
    for process in started:
        if process.proc.poll() is None:
            process.kill()


@pytest.fixture
def refunder(refunders):
    return refunders.start()


def test_listed_called_and_called_again_with_one_refund(
    mcp_server, refunder, sandbox, agent_account
):
    token = token_of(agent_account, "mcp-client")
    mcp = mcp_server.start(AGENTOPS_MCP_REMOTE_AGENTS=NAME)

    async def listing(client):
        return await client.list_tools()

    tools = {tool.name: tool for tool in run_client(mcp.url, token, listing).tools}
    assert tools[TOOL].input_schema["required"] == ["order_id", "amount_cents"]
    assert tools[TOOL].annotations.destructive_hint is True

    done = call_until_final(mcp.url, token, TOOL, SMALL, key="refund-1002")
    assert not done.is_error, (done.structured_content, refunder.seen)
    body = done.structured_content
    assert body["status"] == "succeeded" and body["result"]["amount_cents"] == 700
    again = call(mcp.url, token, TOOL, SMALL, key="refund-1002")
    assert again.structured_content["result"] == body["result"]
    assert len(refund_posts(sandbox)) == 1 and len(refunds(sandbox)) == 1

    run = Run.objects.get(agent_name=NAME)
    assert run.principal == agent_account
    recorded = GatewayCall.objects.get(run=run)
    made = ToolCall.objects.get(run=run)
    # proposed by the agent's process under the recorded call's id, sent with the run's key
    assert made.client_call_id == f"mcp-{recorded.id}"
    assert refunds(sandbox)[0]["idempotency_key"] == made.idempotency_key
    assert body["agentops"]["tool_call_id"] == str(made.id)
    types = event_types(run.id)
    assert types.count("mcp.call_received") == 1
    for expected in ("run.claimed", "tool.dispatching", "tool.succeeded"):
        assert expected in types, types


def test_an_approval_gated_call_answers_awaiting_then_the_refund_once(
    mcp_server, refunder, sandbox, agent_account, approver
):
    token = token_of(agent_account, "mcp-client")
    mcp = mcp_server.start(AGENTOPS_MCP_REMOTE_AGENTS=NAME)

    held = call_until_awaiting(mcp.url, token)
    approval = Approval.objects.get(id=held["agentops"]["approval_id"])
    assert refund_posts(sandbox) == []

    console = DjangoClient()
    console.force_login(approver)
    response = console.post(reverse("approvals:decide", args=[approval.id]), {"action": "approve"})
    assert response.status_code == 302, response.content[:500]

    done = call_until_final(mcp.url, token, TOOL, LARGE, key="refund-1004")
    assert not done.is_error, (done.structured_content, refunder.seen)
    assert done.structured_content["result"]["amount_cents"] == 20_000
    once_more = call(mcp.url, token, TOOL, LARGE, key="refund-1004")
    assert once_more.structured_content["result"] == done.structured_content["result"]
    assert len(refund_posts(sandbox)) == 1 and len(refunds(sandbox)) == 1
    run = Run.objects.get(agent_name=NAME)
    assert ToolCall.objects.filter(run=run).count() == 1
    types = event_types(run.id)
    for expected in ("mcp.call_received", "approval.requested", "approval.decided"):
        assert expected in types, types
    assert types.index("approval.decided") < types.index("tool.dispatching")


def call_until_awaiting(url: str, token: str, timeout: float = 40) -> dict:
    """The held call answers "pending" until the agent's process proposed it, then
    "awaiting_approval" once the policy asked a person."""
    import time

    end = time.monotonic() + timeout
    while True:
        body = call(url, token, TOOL, LARGE, key="refund-1004").structured_content
        if body["status"] == "awaiting_approval":
            return body
        assert body["status"] == "pending", body
        assert time.monotonic() < end, body


def test_agent_killed_between_refund_and_receipt_then_reconciled_not_repeated(
    mcp_server, refunders, worker_procs, sandbox, agent_account
):
    """The agent's process refunds and is SIGKILLed before it records anything; a worker's
    sweeper expires its lease, a second process finds the call unknown, looks the key up and
    records the refund it found; the MCP client, calling again with the same key, gets it."""
    token = token_of(agent_account, "mcp-client")
    worker_procs.start("sweeper", worker_env(sandbox)).wait_running()
    mcp = mcp_server.start(AGENTOPS_MCP_REMOTE_AGENTS=NAME)
    first = refunders.start("--hold-after-tool")

    held: dict = {}
    thread = threading.Thread(
        target=lambda: held.update(body=call(mcp.url, token, TOOL, SMALL, key="r-1002")),
        daemon=True,
    )
    thread.start()
    first.wait_for("refunded", timeout=30)
    first.kill()
    thread.join(30)
    assert len(refund_posts(sandbox)) == 1
    assert ToolCall.objects.get(tool_name=TOOL).status == ToolCall.Status.DISPATCHING

    second = refunders.start()
    done = call_until_final(mcp.url, token, TOOL, SMALL, key="r-1002", timeout=60)
    assert not done.is_error, (done.structured_content, second.seen)
    assert done.structured_content["agentops"]["source"] == ToolReceipt.Source.RECONCILIATION
    assert len(refund_posts(sandbox)) == 1 and len(refunds(sandbox)) == 1
    assert ToolCall.objects.filter(tool_name=TOOL).count() == 1
    types = event_types(Run.objects.get(agent_name=NAME).id)
    assert types.count("mcp.call_received") == 1
    assert "tool.unknown" in types and "tool.succeeded" in types
