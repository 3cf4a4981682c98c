from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runs.registry import (
    Agent,
    CallTool,
    DecisionContext,
    Effect,
    Finish,
    Tool,
    ToolContext,
    ToolResult,
)


def _greet(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(result={"greeting": f"hello {arguments['name']}"})


GREET = Tool(
    name="thirdparty_greet",
    effect=Effect.READ,
    call=_greet,
    schema={
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
        "additionalProperties": False,
    },
)


class Greeter(Agent):
    name = "thirdparty_greeter"
    version = "1"
    tools = ("thirdparty_greet",)

    def decide(self, ctx: DecisionContext):
        if not ctx.steps:
            return CallTool("thirdparty_greet", {"name": ctx.input.get("name", "world")})
        return Finish(ctx.last_step.output)
