"""A remote agent's manifest tools through the MCP gateway (docs/mcp.md, "A remote agent's
tools").

A manifest tool's code runs in the remote agent's own process, so the gateway cannot hand
the call to a worker. It does the same as for its other tools up to that point — checks the
arguments, records the ``tools/call`` once under the client's key or the arguments' digest
(a ``GatewayCall``), signals the run — but the run is a run **of the remote agent** (one per
MCP session or token, as for the gateway's own runs), whose process picks the recorded call
up under its lease: it proposes it with the client call id ``mcp-<GatewayCall id>`` (the
protocol answers a second propose of that id with the same call, so a successor replaying
the same record never makes a second), and from there it is an ordinary call of the
protocol: the manifest's approval policy, dispatch with the key ``<run>:<seq>``, the pre-send
check, the receipt, reconciliation of an unknown outcome. The MCP process only records and
reads; a crash of it loses nothing.

What the agent's process reads here (the API in ``agentops.mcp.api``): which of its runs hold
calls and wait for a process, and the recorded calls of a run it holds the lease of, with
their arguments unmasked (as the resume packet gives the lease holder its calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

from agentops.mcp.models import GatewayCall
from runs.actors import Actor, PermissionDenied
from runs.errors import NotFound
from runs.models import AgentManifest, Run, ToolCall
from runs.registry import Tool
from runs.remote import SEP, is_lease_holder, manifest_tool, short_tool_name

# the client call id a recorded call is proposed under (``[!-~]{1,200}``)
CALL_ID_PREFIX = "mcp-"


def offered_agents() -> list[str]:
    """The remote agents whose manifest tools the gateway offers
    (``AGENTOPS_MCP["REMOTE_AGENTS"]``; none by default)."""
    return list(settings.AGENTOPS_MCP.get("REMOTE_AGENTS") or [])


def remote_tools() -> list[Tool]:
    """The offered remote agents' manifest tools, named ``<agent>/<tool>`` as everywhere
    else (the registry's names), as their manifests declare them now."""
    names = offered_agents()
    if not names:
        return []
    manifests = AgentManifest.objects.filter(name__in=names).only("name", "tools")
    return [manifest_tool(m.name, spec) for m in manifests for spec in m.tools]


def agent_of(tool_name: str) -> str:
    """The offered remote agent ``tool_name`` belongs to, or "" (a tool agentops runs)."""
    agent, sep, _tool = tool_name.rpartition(SEP)
    return agent if sep and agent in offered_agents() else ""


def call_id_for(call: GatewayCall) -> str:
    return f"{CALL_ID_PREFIX}{call.id}"


def tool_call_of(call: GatewayCall) -> ToolCall | None:
    """The engine's call the agent's process proposed for ``call`` (None: not yet)."""
    return (
        ToolCall.objects.filter(run_id=call.run_id, client_call_id=call_id_for(call))
        .select_related("step", "receipt")
        .first()
    )


# --- what the agent's process reads --------------------------------------------------------------


def _require_owner(actor: Actor, agent_name: str) -> None:
    # the agent's owner only (the agent role, named by the manifest): whether the gateway
    # offers the agent's tools is the gateway process's setting, not the web process's
    actor.require_driver(agent_name)


def mcp_runs_waiting(*, agent_name: str, actor: Actor, limit: int = 100) -> list[Run]:
    """The agent's gateway runs that wait for a process (``queued``: a call recorded, a wait
    ended, an approval decided, a lease expired), oldest first: lease them and serve them."""
    _require_owner(actor, agent_name)
    return list(
        Run.objects.filter(
            agent_name=agent_name,
            status=Run.Status.QUEUED,
            gateway_calls__isnull=False,
        )
        .distinct()
        .order_by("created_at")[:limit]
    )


@dataclass(frozen=True)
class RecordedCall:
    position: int
    call_id: str
    tool: str
    arguments: dict[str, Any]
    tool_call_id: int | None
    tool_call_status: str | None


def mcp_calls_of(*, run_id: Any, actor: Actor) -> list[RecordedCall]:
    """The recorded ``tools/call`` requests of a gateway run, in order, for the process that
    holds its lease (it receives their arguments unmasked, as it does its calls'). A call
    already proposed names its engine call (``tool_call_id``): propose only the others."""
    run = Run.objects.filter(id=run_id).first()
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    _require_owner(actor, run.agent_name)
    if not is_lease_holder(actor.user, run):
        raise PermissionDenied("only the process that holds the run's lease reads its calls")
    calls = list(GatewayCall.objects.filter(run_id=run.id).order_by("position"))
    proposed = {
        client_id: (tool_call_id, status)
        for client_id, tool_call_id, status in ToolCall.objects.filter(
            run_id=run.id, client_call_id__startswith=CALL_ID_PREFIX
        ).values_list("client_call_id", "id", "status")
    }
    recorded = []
    for call in calls:
        tool_call_id, status = proposed.get(call_id_for(call), (None, None))
        recorded.append(
            RecordedCall(
                position=call.position,
                call_id=call_id_for(call),
                tool=short_tool_name(run.agent_name, call.tool_name),
                arguments=call.arguments,
                tool_call_id=tool_call_id,
                tool_call_status=status,
            )
        )
    return recorded
