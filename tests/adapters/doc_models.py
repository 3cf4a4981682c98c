"""Offline stand-ins for the models of the agents in docs/remote-agents.md ("Framework
adapters"), for ``test_documented_glue``: ask for the refund of the order in the prompt
(``Refund this order: {...}``), then answer with what the tool returned. No network."""

from __future__ import annotations

import ast
from typing import Any


def _order(prompt: str) -> dict[str, Any]:
    return ast.literal_eval(prompt.split(": ", 1)[1])


def pydantic_model() -> Any:
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import FunctionModel

    def respond(messages, info) -> ModelResponse:
        returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        if returns:
            return ModelResponse(parts=[TextPart(f"done: {returns[-1].content}")])
        order = _order(messages[0].parts[-1].content)
        return ModelResponse(parts=[ToolCallPart("refund_payment", order, tool_call_id="c-1")])

    return FunctionModel(respond)


def openai_model() -> Any:
    import json

    from agents import set_tracing_disabled
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from agents.usage import Usage
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    set_tracing_disabled(True)  # offline: no trace export

    class Scripted(Model):
        async def get_response(self, system_instructions, input, *args: Any, **kwargs: Any):
            items = [input] if isinstance(input, str) else list(input)
            outputs = [
                i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"
            ]
            if outputs:
                text = ResponseOutputText(
                    type="output_text", text=f"done: {outputs[-1]['output']}", annotations=[]
                )
                message = ResponseOutputMessage(
                    id="m-1", type="message", role="assistant", status="completed", content=[text]
                )
                return ModelResponse(output=[message], usage=Usage(), response_id=None)
            prompt = items[0] if isinstance(items[0], str) else items[0]["content"]
            call = ResponseFunctionToolCall(
                type="function_call",
                call_id="c-1",
                name="refund_payment",
                arguments=json.dumps(_order(prompt)),
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any):
            raise NotImplementedError

    return Scripted()
