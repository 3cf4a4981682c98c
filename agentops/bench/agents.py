"""No-op agents and tools for the benchmark.

Registered only by ``manage.py bench`` (in its own process and in the worker processes it
starts), so the app's registry, pages and API never list them. Each agent calls its tool
``input["steps"]`` times, then finishes: the engine's real path (registry, claim,
boundaries, events) with nothing but the engine's own work per step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from runs.registry import (
    Agent,
    ApprovalPolicy,
    CallTool,
    DecisionContext,
    Effect,
    Finish,
    Tool,
    ToolContext,
    ToolResult,
    registry,
)

READ_AGENT = "bench.read"
IDEMPOTENT_AGENT = "bench.idempotent"
SLOW_AGENT = "bench.slow"
APPROVAL_AGENT = "bench.approval"
SANDBOX_AGENT = "bench.sandbox"
SANDBOX_TOOL = "bench.sandbox_refund"
# where the flow section's sandbox listens, and how long it takes over each refund: read by
# the tool at each call (the workers get them in their environment)
SANDBOX_URL_ENV = "AGENTOPS_BENCH_SANDBOX_URL"
SANDBOX_LATENCY_ENV = "AGENTOPS_BENCH_SANDBOX_LATENCY_MS"
# the sandbox's largest seed order: a cent per refund leaves room for 500,000 of them
SANDBOX_ORDER = "ord_1010"

_STEPS_SCHEMA = {
    "type": "object",
    "properties": {
        "steps": {"type": "integer", "minimum": 1},
        "sleep": {"type": "number", "minimum": 0},
    },
    "required": ["steps"],
}
_ARGS_SCHEMA = {
    "type": "object",
    "properties": {"i": {"type": "integer"}, "sleep": {"type": "number"}},
    "required": ["i"],
}

# perf_counter / process_time at each decide(), per run id: the in-process overhead
# measurement reads the gaps between consecutive decisions of one run (one step each).
decide_marks: dict[str, list[tuple[float, float]]] = {}
recording = False


def _noop(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(result={"i": arguments["i"]})


def _sleepy(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    # a tool that takes a while, so a worker is seen holding runs when it is killed
    time.sleep(float(arguments.get("sleep", 0.1)))
    return ToolResult(result={"i": arguments["i"]})


def _sandbox_refund(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    """A one-cent refund at the sandbox payments service (agentops.demo.sandbox), which holds
    each one for a few milliseconds (its latency fault) and counts the refunds it is handling
    at once: the downstream's own view of how many calls were in flight (the flow section).
    Sent as the demo's HTTP tools send (``runs.toolhttp``: key, fence, send deadline)."""
    from agentops.demo.sandbox import FAULT_HEADER
    from runs import toolhttp

    latency_ms = int(os.environ.get(SANDBOX_LATENCY_ENV, "5"))
    response = toolhttp.request(
        ctx,
        "POST",
        os.environ[SANDBOX_URL_ENV].rstrip("/") + "/refunds",
        json={
            "idempotency_key": ctx.idempotency_key,
            "order_id": SANDBOX_ORDER,
            "amount_cents": 1,
            "reason": f"bench {arguments['i']}",
        },
        headers={FAULT_HEADER: f"latency={latency_ms}"},
    )
    body = response.json()
    return ToolResult(result={"i": arguments["i"]}, external_ref=body.get("refund_id", ""))


class _BenchAgent(Agent):
    tool_name = ""
    input_schema = _STEPS_SCHEMA

    def __init__(self) -> None:
        self.tools = (self.tool_name,)

    def decide(self, ctx: DecisionContext) -> Any:
        if recording:
            decide_marks.setdefault(ctx.run_id, []).append(
                (time.perf_counter(), time.process_time())
            )
        done = len(ctx.steps)
        if done >= int(ctx.input["steps"]):
            return Finish(result={"steps": done})
        arguments: dict[str, Any] = {"i": done + 1}
        if "sleep" in ctx.input:
            arguments["sleep"] = ctx.input["sleep"]
        return CallTool(self.tool_name, arguments)


class ReadAgent(_BenchAgent):
    name = READ_AGENT
    description = "benchmark: K no-op read-tool steps"
    tool_name = "bench.noop_read"


class IdempotentAgent(_BenchAgent):
    name = IDEMPOTENT_AGENT
    description = "benchmark: K no-op idempotent-tool steps"
    tool_name = "bench.noop_idempotent"


class SlowAgent(_BenchAgent):
    name = SLOW_AGENT
    description = "benchmark: K read-tool steps that each take input['sleep'] seconds"
    tool_name = "bench.sleepy_read"


class ApprovalAgent(_BenchAgent):
    name = APPROVAL_AGENT
    description = "benchmark: K idempotent-tool steps, each approved by a person"
    tool_name = "bench.approved_idempotent"


class SandboxAgent(_BenchAgent):
    name = SANDBOX_AGENT
    description = "benchmark: K one-cent refunds at the sandbox (the flow section)"
    tool_name = SANDBOX_TOOL


TOOLS = (
    Tool(name="bench.noop_read", effect=Effect.READ, call=_noop, schema=_ARGS_SCHEMA),
    Tool(name="bench.noop_idempotent", effect=Effect.IDEMPOTENT, call=_noop, schema=_ARGS_SCHEMA),
    Tool(
        name="bench.sleepy_read", effect=Effect.READ, call=_sleepy, schema=_ARGS_SCHEMA, timeout=5
    ),
    Tool(
        name="bench.approved_idempotent",
        effect=Effect.IDEMPOTENT,
        call=_noop,
        schema=_ARGS_SCHEMA,
        approval=ApprovalPolicy(when="always", group="approver"),
    ),
    # the sandbox deduplicates refunds by key (it runs with --mode dedupe for the bench)
    Tool(
        name=SANDBOX_TOOL,
        effect=Effect.IDEMPOTENT,
        call=_sandbox_refund,
        schema=_ARGS_SCHEMA,
        timeout=5,
    ),
)
AGENTS = (ReadAgent, IdempotentAgent, SlowAgent, ApprovalAgent, SandboxAgent)


def register() -> None:
    """Idempotent: the bench process and each worker it starts call it once."""
    for tool in TOOLS:
        registry.register_tool(tool)
    for agent_class in AGENTS:
        registry.register_agent(agent_class())


def unregister() -> None:
    """After a bench run inside another process (the test suite): leave no trace."""
    for agent_class in AGENTS:
        registry.unregister_agent(agent_class.name)
    for tool in TOOLS:
        registry.unregister_tool(tool.name)
