"""No-op agents and tools for the benchmark.

Registered only by ``manage.py bench`` (in its own process and in the worker processes it
starts), so the app's registry, pages and API never list them. Each agent calls its tool
``input["steps"]`` times, then finishes: the engine's real path (registry, claim,
boundaries, events) with nothing but the engine's own work per step.
"""

from __future__ import annotations

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
)
AGENTS = (ReadAgent, IdempotentAgent, SlowAgent, ApprovalAgent)


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
