"""An OpenAI Agents SDK agent that refunds an order through agentops, offline: its model is
``ScriptedModel``, written for this test (no network), which asks for the refund named in
the input, then answers with what the tool returned. The glue is the < 20 lines of
docs/remote-agents.md ("Framework adapters").

    AGENTOPS_TOKEN=... SANDBOX_URL=... python -m tests.adapters.openai_refunder URL RUN_ID
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from agents import Agent, set_tracing_disabled
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from agentops.client import Client, LeaseLost
from agentops.client.openai_agents import durable_tool, run_agent
from tests.adapters.refunds import find_refund, refund, say


class ScriptedModel(Model):
    """First turn: call refund_payment with the order in the input. Then: say what the
    tool returned. Counts its turns, so a test can see a replayed turn was not asked."""

    async def get_response(self, system_instructions, input, *args: Any, **kwargs: Any):
        say("model asked")
        items = [input] if isinstance(input, str) else list(input)
        outputs = [
            i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"
        ]
        if outputs:
            if os.environ.get("DIE_BEFORE_ANSWER"):
                os._exit(9)  # the refund's receipt is recorded; the run is not finished
            text = ResponseOutputText(
                type="output_text", text=f"done: {outputs[-1]['output']}", annotations=[]
            )
            message = ResponseOutputMessage(
                id="msg-1", type="message", role="assistant", status="completed", content=[text]
            )
            return ModelResponse(output=[message], usage=Usage(), response_id=None)
        prompt = items[0] if isinstance(items[0], str) else items[0]["content"]
        order = prompt.split(" ", 1)[1]
        call = ResponseFunctionToolCall(
            type="function_call", call_id="call-1", name="refund_payment", arguments=order
        )
        return ModelResponse(output=[call], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any):
        raise NotImplementedError


@durable_tool(lookup=find_refund)
def refund_payment(order_id: str, amount_cents: int) -> dict:
    """Refund part of an order."""
    return refund(order_id, amount_cents)


agent = Agent(name="refunder", model=ScriptedModel(), tools=[refund_payment])


def main(url: str, run_id: str) -> int:
    set_tracing_disabled(True)  # offline: no trace export
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
