"""Pydantic AI agents whose side-effecting tools are durable calls of an agentops run.

    from agentops.client.pydantic_ai import AgentopsToolset, current_call, run_agent

    def refund_payment(order_id: str, amount_cents: int) -> dict:
        call = current_call()                       # the key, and a request never sent late
        return call.request("POST", REFUNDS, json={"idempotency_key": call.idempotency_key,
                            "order_id": order_id, "amount_cents": amount_cents}).json()

    tools = AgentopsToolset(FunctionToolset([refund_payment]),
                            lookups={"refund_payment": find_refund})
    agent = Agent(model, toolsets=[tools])
    with Client(url, token) as client, client.lease_when_free(run_id) as run:
        print(run_agent(agent, run, f"Refund {run.resume.input}").status)

Each call of a routed tool is proposed to the run (its idempotency key is the run's), gated
by the manifest's approval policy — a call that needs an approval parks the agent as a
Pydantic AI deferred call (``CallDeferred``: the run ends with ``DeferredToolRequests``) and
the process exits; the next process, once a person decided, resumes it — and executed with
the dispatch / pre-send check / receipt protocol; after a crash an unknown outcome is looked
up by key (``lookups``), never blindly sent again.

The message history is checkpointed before a model response's routed calls are acted on —
its new messages appended to the run's history store, the checkpoint step naming them — so a
new process resumes from that response: the model is not asked again for a decision already
acted on (docs/remote-agents.md, "Framework adapters"). The run's state is left alone.

Needs ``pydantic-ai-slim`` (the ``frameworks`` extra); imports no Django.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Collection, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

try:
    from pydantic_ai import CallDeferred, DeferredToolRequests, RunContext
    from pydantic_ai.exceptions import ToolFailed as ModelVisibleFailure
    from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelResponse
    from pydantic_ai.toolsets import ToolsetTool, WrapperToolset
    from pydantic_core import to_jsonable_python
except ImportError as exc:  # pragma: no cover - only without the optional dependency
    raise ImportError(
        "agentops.client.pydantic_ai needs Pydantic AI: pip install 'agentops[frameworks]' "
        "(or pydantic-ai-slim)"
    ) from exc

from . import LookupFn, RemoteRun, ToolContext
from .routing import (
    CURRENT_CALL,
    CallRouter,
    Outcome,
    OutcomeUndecided,
    Routed,
    canonical,
    current_call,
)

__all__ = [
    "STATE_KEY",
    "AgentopsToolset",
    "Outcome",
    "OutcomeUndecided",
    "current_call",
    "run_agent",
]

# where an older version of this adapter kept the message history (the run's state): still
# read, so that a run it checkpointed resumes
STATE_KEY = "pydantic_ai"

_session: ContextVar[_Session | None] = ContextVar("agentops_pydantic_ai", default=None)


@dataclass
class _Session:
    router: CallRouter
    checkpointed: str = ""  # the key of the model response last checkpointed
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _response_key(history: list[Any]) -> str:
    """What identifies the model response a history ends with, also once it was stored and
    loaded again: its place and its tool calls (ids, tools, arguments) — not its dump,
    which a framework may stamp anew when it resumes."""
    responses = [m for m in history if isinstance(m, ModelResponse)]
    calls = [(p.tool_call_id, p.tool_name, p.args_as_dict()) for p in responses[-1].tool_calls]
    return hashlib.sha256(canonical([len(responses), calls]).encode()).hexdigest()


@dataclass
class AgentopsToolset(WrapperToolset[Any]):
    """Wraps a toolset: calls of its tools named in ``route`` (default: all of them) go
    through the leased run of ``run_agent``. Each routed tool must be declared, under the
    same name, in the agent's manifest (effect class, argument schema, approval policy).
    ``lookups``: the lookup by idempotency key of each ``reconcilable`` tool
    (``(key, arguments) -> Found``)."""

    lookups: Mapping[str, LookupFn] = field(default_factory=dict)
    route: Collection[str] | None = None

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        if self.route is not None and name not in self.route:
            return await super().call_tool(name, tool_args, ctx, tool)
        session = _session.get()
        if session is None:
            raise RuntimeError(f"{name} is routed through agentops: run the agent with run_agent()")
        await self._checkpoint(session, ctx)
        loop = asyncio.get_running_loop()

        def body(arguments: Mapping[str, Any], call: ToolContext) -> Any:
            # the router runs in a worker thread; the tool itself runs on the agent's loop
            return asyncio.run_coroutine_threadsafe(
                self._call_wrapped(name, arguments, ctx, tool, call), loop
            ).result()

        routed: Routed = await asyncio.to_thread(
            session.router.route,
            name,
            to_jsonable_python(tool_args),
            body,
            lookup=self.lookups.get(name),
            framework_call_id=ctx.tool_call_id or "",
        )
        if routed.status == "succeeded":
            return routed.result
        if routed.status == "parked":
            # a Pydantic AI deferred call: the run ends with DeferredToolRequests
            raise CallDeferred(
                {"agentops": {"tool_call": routed.tool_call_id, "detail": routed.detail}}
            )
        raise ModelVisibleFailure(f"{name} {routed.status}: {routed.detail or routed.result}")

    async def _call_wrapped(
        self,
        name: str,
        arguments: Mapping[str, Any],
        ctx: RunContext[Any],
        tool: ToolsetTool[Any],
        call: ToolContext,
    ) -> Any:
        token = CURRENT_CALL.set(call)
        try:
            # an approver may have edited the arguments: the dispatched ones, validated again
            validated = tool.args_validator.validate_python(dict(arguments))
            return await super().call_tool(name, validated, ctx, tool)
        finally:
            CURRENT_CALL.reset(token)

    async def _checkpoint(self, session: _Session, ctx: RunContext[Any]) -> None:
        """Before the first routed call of a model response: the history up to that
        response, its new messages appended to the run's history store and named by the
        ``decided`` step. Once per response."""
        messages = list(ctx.messages)
        last = max(
            (i for i, m in enumerate(messages) if isinstance(m, ModelResponse)), default=None
        )
        if last is None:
            return
        history = messages[: last + 1]
        key = _response_key(history)
        async with session.lock:
            if key == session.checkpointed:
                return
            dumped = ModelMessagesTypeAdapter.dump_python(history, mode="json")
            calls = [
                {"id": part.tool_call_id, "tool": part.tool_name, "arguments": part.args_as_dict()}
                for part in history[-1].tool_calls
            ]
            await asyncio.to_thread(
                session.router.checkpoint, lambda seq: dumped, {"tool_calls": calls}
            )
            session.checkpointed = key


def run_agent(
    agent: Any,
    run: RemoteRun,
    prompt: str | None = None,
    *,
    finish: bool = True,
    **kwargs: Any,
) -> Outcome:
    """Run (or resume) ``agent`` on the leased ``run``. A new run starts from ``prompt``; a
    run with a checkpointed history resumes from its last model response (``prompt`` is then
    ignored). ``finished``: the agent's output, and with ``finish`` the run is finished with
    it; ``parked``: the run waits for a person (an approval, an unknown outcome) and the
    lease is released — exit, and run this again when the ``approval.decided`` webhook
    arrives. ``LeaseLost`` propagates: stop. ``OutcomeUndecided`` (lookups could not tell
    whether a call acted) propagates too: the call stays unknown for a person to see."""
    router = CallRouter(run)
    session = _Session(router)
    saved = router.last_checkpoint()
    if saved is None and run.resume.state.get(STATE_KEY):
        legacy = run.resume.state[STATE_KEY]  # checkpointed by an older version
        saved = (legacy["seq"], legacy["messages"])
    history = None
    if saved is not None:
        seq, messages = saved
        history = ModelMessagesTypeAdapter.validate_python(messages)
        router.resume_from(seq)
        session.checkpointed = _response_key(history)
        prompt = None
    output_type = kwargs.pop("output_type", agent.output_type)
    if not isinstance(output_type, list | tuple):
        output_type = [output_type]
    if DeferredToolRequests not in output_type:
        output_type = [*output_type, DeferredToolRequests]  # how a parked call ends the run
    token = _session.set(session)
    try:
        result = agent.run_sync(prompt, message_history=history, output_type=output_type, **kwargs)
    finally:
        _session.reset(token)
    if isinstance(result.output, DeferredToolRequests):
        parked = router.parked
        return Outcome("parked", result.output, parked.detail if parked else "deferred")
    output = to_jsonable_python(result.output)
    if finish:
        run.finish(output)
    return Outcome("finished", output)
