"""Release 1 and release 2 of one agent: release 2 changed the agent (a state migration from
1) and its tool's code (another fingerprint). Each step writes which release ran it into
the result, so the test sees who served what."""

from __future__ import annotations

import os
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

RELEASE = os.environ.get("ROLLING_VERSION", "1")


def _read_v1(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(result={"release": "1", "n": arguments["n"]})


def _read_v2(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(result={"release": "2", "n": arguments["n"], "v2": True})


class Rolling(Agent):
    name = "rolling"
    tools = ("rolling_read",)

    def __init__(self, release: str) -> None:
        self.version = release
        if release == "2":
            self.migrations = (("1", "2", lambda state: {**state, "migrated": True}),)

    def decide(self, ctx: DecisionContext):
        if len(ctx.steps) < 3:
            return CallTool("rolling_read", {"n": len(ctx.steps)})
        return Finish(
            {
                "served_by": [step.output["release"] for step in ctx.steps],
                "decided_by": self.version,
                "migrated": bool(ctx.state.get("migrated")),
            }
        )


def build(release: str = RELEASE) -> tuple[Tool, Agent]:
    tool = Tool(
        name="rolling_read",
        effect=Effect.READ,
        call=_read_v2 if release == "2" else _read_v1,
        schema={"type": "object", "properties": {"n": {"type": "integer"}}},
        # release 2 knows release 1's tool and declares it compatible on purpose (a call
        # decided under it goes on); release 1 cannot know release 2's
        compatible_with=(build("1")[0].version,) if release == "2" else (),
    )
    return tool, Rolling(release)
