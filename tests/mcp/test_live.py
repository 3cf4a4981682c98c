"""The MCP SDK's own client against a live ``runmcp`` process and a live ``runworker``, the
demo sandbox (non-deduplicating) downstream: what an MCP client sees, and what the sandbox's
own ledger and the run's timeline say happened."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
from django.test import Client as DjangoClient
from django.urls import reverse

from agentops.mcp.gateway import AGENT_NAME
from agentops.mcp.models import GatewayCall
from approvals.models import Approval
from runs.models import Run, ToolCall, ToolReceipt
from tests.mcp.conftest import NOTE_SCHEMA, call, call_until_final, run_client, token_of
from tests.runs.workerprocs import worker_env
from tests.support import event_types, refund_posts, refunds

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LARGE = {"order_id": "ord_1004", "amount_cents": 20_000}  # above the approval threshold
SMALL = {"order_id": "ord_1002", "amount_cents": 700}


def test_list_read_gated_approve_and_call_again(
    mcp_server, worker_procs, sandbox, agent_account, approver
):
    token = token_of(agent_account, "mcp-client")
    worker_procs.start("w1", worker_env(sandbox)).wait_running()
    mcp = mcp_server.start()

    async def listing(client):
        return await client.list_tools()

    tools = {tool.name: tool for tool in run_client(mcp.url, token, listing).tools}
    assert {"lookup_order", "refund_payment", "send_notification"} <= set(tools)
    assert tools["refund_payment"].input_schema["required"] == ["order_id", "amount_cents"]
    assert tools["lookup_order"].annotations.read_only_hint is True

    read = call(mcp.url, token, "lookup_order", {"order_id": "ord_1004"})
    assert not read.is_error, read
    assert read.structured_content["status"] == "succeeded"
    assert read.structured_content["result"]["order_id"] == "ord_1004"
    # the same arguments again in the run (no key of the client's): the same call, not another
    again = call(mcp.url, token, "lookup_order", {"order_id": "ord_1004"})
    assert again.structured_content["result"] == read.structured_content["result"]
    assert ToolCall.objects.filter(tool_name="lookup_order").count() == 1

    held = call(mcp.url, token, "refund_payment", LARGE, key="refund-ord_1004")
    assert not held.is_error
    body = held.structured_content
    assert body["status"] == "awaiting_approval", body
    approval = Approval.objects.get(id=body["agentops"]["approval_id"])
    assert refund_posts(sandbox) == []

    # the approver decides in the console
    console = DjangoClient()
    console.force_login(approver)
    response = console.post(reverse("approvals:decide", args=[approval.id]), {"action": "approve"})
    assert response.status_code == 302, response.content[:500]

    done = call_until_final(mcp.url, token, "refund_payment", LARGE, key="refund-ord_1004")
    assert not done.is_error, done
    assert done.structured_content["result"]["amount_cents"] == 20_000
    once_more = call(mcp.url, token, "refund_payment", LARGE, key="refund-ord_1004")
    assert once_more.structured_content["result"] == done.structured_content["result"]
    assert len(refund_posts(sandbox)) == 1 and len(refunds(sandbox)) == 1

    run = Run.objects.get(agent_name=AGENT_NAME)
    assert run.principal == agent_account
    assert GatewayCall.objects.filter(run=run).count() == 2
    # each recorded call names the engine's call it became
    assert set(GatewayCall.objects.values_list("tool_call__tool_name", flat=True)) == {
        "lookup_order",
        "refund_payment",
    }
    types = event_types(run.id)
    assert types.count("mcp.call_received") == 2
    for expected in ("approval.requested", "approval.decided", "tool.succeeded"):
        assert expected in types


def test_mcp_process_killed_mid_call_then_the_outcome_is_reconciled_not_repeated(
    mcp_server, worker_procs, sandbox, agent_account
):
    """The worker dies right after the sandbox applied the refund (before any receipt) and
    the MCP process is SIGKILLed while the client's call is held. After both restart, the
    same call (same key) answers the refund found by lookup: one refund in the sandbox."""
    token = token_of(agent_account, "mcp-client")
    crashing = worker_procs.start("w1", worker_env(sandbox, AGENTOPS_CRASH_AT="tool_call"))
    crashing.wait_running()
    mcp = mcp_server.start()

    first: dict[str, Any] = {}

    def held_call() -> None:
        try:
            first["result"] = call(mcp.url, token, "refund_payment", SMALL, key="r-1002")
        except BaseException as exc:  # the server dies under it
            first["error"] = exc

    thread = threading.Thread(target=held_call, daemon=True)
    thread.start()
    crashing.wait_exit(30)  # SIGKILLed itself between the effect and the receipt
    assert len(refund_posts(sandbox)) == 1
    assert ToolCall.objects.get(tool_name="refund_payment").status == "dispatching"
    mcp.kill()
    thread.join(30)
    assert "result" not in first or first["result"].structured_content["status"] != "succeeded"

    worker_procs.start("w2", worker_env(sandbox)).wait_running()
    mcp = mcp_server.start()
    done = call_until_final(mcp.url, token, "refund_payment", SMALL, key="r-1002")
    assert not done.is_error, done
    assert done.structured_content["agentops"]["source"] == ToolReceipt.Source.RECONCILIATION
    assert len(refund_posts(sandbox)) == 1 and len(refunds(sandbox)) == 1
    assert ToolCall.objects.filter(tool_name="refund_payment").count() == 1
    run = Run.objects.get(agent_name=AGENT_NAME)
    types = event_types(run.id)
    assert types.count("mcp.call_received") == 1
    assert "tool.unknown" in types and "tool.succeeded" in types


def test_tokens_other_than_an_agents_are_refused(mcp_server, agent_account, operator):
    mcp = mcp_server.start()
    operator_token = token_of(operator, "operator-token")
    no_token = httpx.post(mcp.url, json={}, timeout=5)
    assert no_token.status_code == 401
    assert no_token.headers["www-authenticate"].startswith("Bearer")
    bad = httpx.post(mcp.url, json={}, headers={"Authorization": "Bearer ao_nope"}, timeout=5)
    assert bad.status_code == 401
    wrong_role = httpx.post(
        mcp.url, json={}, headers={"Authorization": f"Bearer {operator_token}"}, timeout=5
    )
    assert wrong_role.status_code == 403

    # a proxy in front forwards the site's own Host (one of ALLOWED_HOSTS); any other is
    # refused by the SDK's DNS-rebinding check, whatever the token
    agent_token = token_of(agent_account, "mcp-client")
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    for host, refused in (("testserver", False), ("evil.example:80", True)):
        response = httpx.post(
            mcp.url,
            json=initialize,
            headers={
                "Authorization": f"Bearer {agent_token}",
                "Host": host,
                "Accept": "application/json, text/event-stream",
            },
            timeout=5,
        )
        assert (response.status_code == 421) == refused, (host, response.status_code)

    async def listing(client):
        return await client.list_tools()

    for token in ("ao_nope", operator_token):
        with pytest.raises(BaseException):  # noqa: B017 - the SDK wraps the HTTP refusal
            run_client(mcp.url, token, listing)
    assert not Run.objects.exists()
    assert not GatewayCall.objects.exists()


def test_a_tool_of_an_upstream_mcp_server_through_the_gateway(
    mcp_server, worker_procs, sandbox, agent_account, upstream
):
    """agentops between an MCP client and someone else's MCP tools: the client calls the
    gateway, a worker calls the upstream once, with the call's key."""
    config = json.dumps(upstream.config())
    token = token_of(agent_account, "mcp-client")
    worker = worker_procs.start("w1", worker_env(sandbox, AGENTOPS_MCP_UPSTREAMS=config))
    worker.wait_running()
    mcp = mcp_server.start(AGENTOPS_MCP_UPSTREAMS=config)

    async def listing(client):
        return await client.list_tools()

    tools = {tool.name: tool for tool in run_client(mcp.url, token, listing).tools}
    assert tools["notes.add_note"].input_schema == NOTE_SCHEMA
    done = call_until_final(mcp.url, token, "notes.add_note", {"text": "hi"}, key="note-1")
    assert done.structured_content.get("result") == {"note": 1}, (
        done.structured_content,
        list(ToolCall.objects.values("status", "last_error")),
        worker.output(),
    )
    again = call(mcp.url, token, "notes.add_note", {"text": "hi"}, key="note-1")
    assert again.structured_content["result"] == {"note": 1}
    made = ToolCall.objects.get(tool_name="notes.add_note")
    assert upstream.ledger == [{"text": "hi", "key": made.idempotency_key}]
