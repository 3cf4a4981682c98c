"""A remote agent's manifest tool through the gateway, in-process: what is offered to whom,
what a ``tools/call`` records and where, what the agent's process reads, and what the held
request answers as the process proposes the call."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from rest_framework.test import APIClient

from agentops.demo.mcp_refunder import MANIFEST, NAME
from agentops.mcp import selectors, services
from agentops.mcp.models import GatewayCall
from runs.actors import Actor
from runs.models import Run, Signal
from runs.remote import agent_manifest_put, remote_lease_acquire, remote_toolcall_propose
from runs.services import InvalidState
from runs.tokens import api_token_create
from tests.support import event_types

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

TOOL = f"{NAME}/refund_payment"
SMALL = {"order_id": "ord_1002", "amount_cents": 700}


@pytest.fixture
def offered(settings, robot, django_user_model):
    """The refunder's manifest, owned by ``robot``, and the gateway offering its tools."""
    settings.AGENTOPS_MCP = {**settings.AGENTOPS_MCP, "REMOTE_AGENTS": [NAME]}
    admin = django_user_model.objects.create_superuser("root", password="x")
    agent_manifest_put(
        name=NAME,
        manifest={**MANIFEST, "owner": robot.username},
        actor=Actor.for_user(admin, "cli"),
    )


@pytest.fixture
def client_token(django_user_model):
    user = django_user_model.objects.create_user("mcp-client-bot")
    user.groups.add(Group.objects.get(name="agent"))
    made, _ = api_token_create(name="mcp", principal=user, actor=Actor.system("cli"))
    return made


def api_for(user) -> APIClient:
    _, raw = api_token_create(name=f"t-{user.username}", principal=user, actor=Actor.system("cli"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def record(token, **kwargs) -> GatewayCall:
    return services.gateway_call_record(
        token=token, tool_name=TOOL, arguments=dict(SMALL), session="s1", **kwargs
    )


def test_offered_only_when_configured(settings, robot, client_token, django_user_model):
    admin = django_user_model.objects.create_superuser("root", password="x")
    agent_manifest_put(
        name=NAME,
        manifest={**MANIFEST, "owner": robot.username},
        actor=Actor.for_user(admin, "cli"),
    )
    assert TOOL not in {tool.name for tool in services.tools_for(client_token.principal)}
    with pytest.raises(services.ToolNotOffered):
        record(client_token)
    settings.AGENTOPS_MCP = {**settings.AGENTOPS_MCP, "REMOTE_AGENTS": [NAME]}
    assert TOOL in {tool.name for tool in services.tools_for(client_token.principal)}


def test_recorded_in_a_run_of_the_agent_and_signalled_once(offered, client_token):
    first = record(client_token, client_key="k1")
    run = first.run
    assert (run.agent_name, run.principal_id, run.status) == (
        NAME,
        client_token.principal_id,
        Run.Status.QUEUED,
    )
    again = record(client_token, client_key="k1")
    assert again.id == first.id
    assert Signal.objects.filter(run=run, name="mcp.call").count() == 1
    assert event_types(run.id).count("mcp.call_received") == 1
    pending = selectors.gateway_call_outcome(call_id=first.id)
    assert pending.status == selectors.PENDING
    assert pending.handle["waiting_for"] == "the agent's process"
    # the gateway's own tools still go into the gateway's run, apart
    with pytest.raises(InvalidState):
        record(client_token, client_key="k2", dry_run=True)


def test_only_the_lease_holder_reads_the_calls_and_its_propose_is_the_call(
    offered, client_token, robot, django_user_model
):
    call = record(client_token, client_key="k1")
    run_id = call.run_id
    owner = api_for(robot)
    waiting = owner.get(f"/api/v1/agents/{NAME}/mcp-runs/")
    assert waiting.status_code == 200 and [r["id"] for r in waiting.json()] == [str(run_id)]
    stranger = django_user_model.objects.create_user("other-bot")
    stranger.groups.add(Group.objects.get(name="agent"))
    assert api_for(stranger).get(f"/api/v1/agents/{NAME}/mcp-runs/").status_code == 403
    # the owner, without the lease: not the arguments
    assert owner.get(f"/api/v1/runs/{run_id}/mcp-calls/").status_code == 403

    actor = Actor(label="token:t-robby", channel="api", user=robot)
    grant = remote_lease_acquire(run_id=run_id, actor=actor)
    calls = owner.get(f"/api/v1/runs/{run_id}/mcp-calls/").json()
    assert calls == [
        {
            "position": 1,
            "call_id": f"mcp-{call.id}",
            "tool": "refund_payment",
            "arguments": SMALL,
            "tool_call_id": None,
            "tool_call_status": None,
        }
    ]
    proposal = remote_toolcall_propose(
        run_id=run_id,
        fence=grant.fence,
        lease_token=grant.lease_token,
        actor=actor,
        tool="refund_payment",
        arguments=SMALL,
        client_call_id=calls[0]["call_id"],
    )
    outcome = selectors.gateway_call_outcome(call_id=call.id)
    assert outcome.status == selectors.PENDING
    assert outcome.handle["tool_call_status"] == "proposed"  # not dispatched yet
    assert outcome.unlinked_tool_call == proposal.call.id
    assert owner.get(f"/api/v1/runs/{run_id}/mcp-calls/").json()[0]["tool_call_id"] == (
        proposal.call.id
    )
