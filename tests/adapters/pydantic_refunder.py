"""A Pydantic AI agent that refunds an order through agentops, offline: its model is a
``FunctionModel`` that asks for the refund named in the prompt, then answers. The glue
is the < 20 lines of docs/remote-agents.md ("Framework adapters").

    AGENTOPS_TOKEN=... SANDBOX_URL=... python -m tests.adapters.pydantic_refunder URL RUN_ID
"""

from __future__ import annotations

import json
import os
import sys

from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

from agentops.client import Client, LeaseLost
from agentops.client.pydantic_ai import AgentopsToolset, run_agent
from tests.adapters.refunds import find_refund, refund, say


def refund_payment(order_id: str, amount_cents: int) -> dict:
    """Refund part of an order."""
    return refund(order_id, amount_cents)


def model(messages, info: AgentInfo) -> ModelResponse:
    say("model asked")
    returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
    if returns:
        if os.environ.get("DIE_BEFORE_ANSWER"):
            os._exit(9)  # the refund's receipt is recorded; the run is not finished
        return ModelResponse(parts=[TextPart(f"done: {json.dumps(returns[-1].content)}")])
    prompt = messages[0].parts[-1].content
    order = json.loads(prompt.split(" ", 1)[1])
    return ModelResponse(parts=[ToolCallPart("refund_payment", order, tool_call_id="call-1")])


tools = AgentopsToolset(FunctionToolset([refund_payment]), lookups={"refund_payment": find_refund})
agent = Agent(FunctionModel(model), toolsets=[tools])


def main(url: str, run_id: str) -> int:
    try:
        with (
            Client(url, os.environ["AGENTOPS_TOKEN"]) as client,
            client.lease_when_free(run_id, wait=30, poll=0.1) as run,
        ):
            outcome = run_agent(agent, run, f"refund {json.dumps(run.resume.input)}")
    except LeaseLost as exc:
        say(f"lease lost: {exc.detail}")
        return 3
    say(f"{outcome.status}: {outcome.detail or outcome.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
