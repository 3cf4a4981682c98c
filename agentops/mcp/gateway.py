"""The ``mcp-gateway`` hosted agent: its runs are driven by MCP clients (docs/mcp.md).

The MCP server never calls a tool. It records each ``tools/call`` as a ``GatewayCall`` of a
run and signals the run; this agent, run by the workers like any other, turns the run's
n-th recorded call into its n-th tool-call step. From there the engine does what it does
for every call: the approval gate, the dispatch with its key, the receipt, reconciliation
of an unknown outcome after a crash. A crash of the MCP process loses nothing: the record
holds the call, and the client's next ``tools/call`` with the same key reads its outcome.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from runs.registry import (
    Agent,
    CallTool,
    DecisionContext,
    Finish,
    Tool,
    WaitForSignal,
    registry,
)

AGENT_NAME = "mcp-gateway"
# the signal a recorded call sends its run; the agent never reads its payload (the record of
# calls is the GatewayCall table), so a spare signal only costs one more wake-up
SIGNAL = "mcp.call"


def exposed_tools() -> list[Tool]:
    """The registered tools the gateway offers (``AGENTOPS_MCP["TOOLS"]``, empty: all)."""
    names = settings.AGENTOPS_MCP["TOOLS"]
    return [tool for tool in registry.tools() if not names or tool.name in names]


class GatewayAgent(Agent):
    name = AGENT_NAME
    version = "1"
    description = "Runs the tool calls of an MCP client (the MCP gateway, docs/mcp.md)."
    searchable_input = ("session",)
    input_schema = {
        "type": "object",
        "properties": {"session": {"type": "string", "maxLength": 200}},
        "additionalProperties": False,
    }

    @property
    def tools(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(tool.name for tool in exposed_tools())

    def decide(self, ctx: DecisionContext) -> Any:
        from agentops.mcp.models import GatewayCall

        # Deterministic from the record: the n-th tool-call step is the n-th recorded call
        # (refused calls are tool-call steps too), so a resumed run decides the same.
        made = sum(1 for step in ctx.steps if step.kind == "tool_call")
        recorded = (
            GatewayCall.objects.filter(run_id=ctx.run_id, position=made + 1)
            .values_list("tool_name", "arguments")
            .first()
        )
        if recorded is not None:
            return CallTool(recorded[0], recorded[1])
        last = ctx.last_step
        if (
            last is not None
            and last.kind == "wait"
            and last.status == "completed"
            and isinstance(last.output, dict)
            and last.output.get("idle")
        ):
            return Finish({"calls": made})
        return WaitForSignal(
            SIGNAL, timeout_seconds=settings.AGENTOPS_MCP["IDLE_SECONDS"], default={"idle": True}
        )


def register() -> None:
    registry.register_agent(GatewayAgent())
