"""OpenAI Agents SDK agents whose side-effecting tools are durable calls of an agentops run.

    from agentops.client.openai_agents import current_call, durable_tool, run_agent

    @durable_tool(lookup=find_refund)             # needs_approval: the run's approval policy
    def refund_payment(order_id: str, amount_cents: int) -> dict:
        call = current_call()                       # the key, and a request never sent late
        return call.request("POST", REFUNDS, json={"idempotency_key": call.idempotency_key,
                            "order_id": order_id, "amount_cents": amount_cents}).json()

    agent = Agent(name="refunder", model=model, tools=[refund_payment])
    with Client(url, token) as client, client.lease_when_free(run_id) as run:
        print(run_agent(agent, run, f"Refund {run.resume.input}").status)

A ``durable_tool``'s ``needs_approval`` is the run's gate: the call is proposed to the run
(its idempotency key is the run's) and the manifest's policy decides. A call that needs an
approval interrupts the SDK's run (``result.interruptions``); the lease is released and the
process exits. A person decides in agentops (console, email, API) — never with
``RunState.approve``: the approval is bound to the call's arguments and audited there — and
the next process resumes. The tool body runs with the dispatch / pre-send check / receipt
protocol; after a crash an unknown outcome is looked up by key (``lookup``), never blindly
sent again.

The model's responses that call tools are checkpointed before the calls are acted on (each
appended to the run's history store, the checkpoint step naming it; the run's state is left
alone); a new process runs the agent again on the same input and each recorded
response is replayed instead of asking the model again, so the same decisions are acted on
and each call matches the one the run recorded. Only ``Runner.run`` (not streaming), and
the agent passed in (a handoff's agent asks its own model unrecorded).

Needs ``openai-agents`` (the ``frameworks`` extra); imports no Django.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

try:
    from agents import Agent, FunctionTool, Runner, function_tool
    from agents.items import ModelResponse, TResponseOutputItem
    from agents.models.interface import Model
    from agents.models.multi_provider import MultiProvider
    from agents.run_context import RunContextWrapper
    from agents.tool_context import ToolContext as SdkToolContext
    from agents.usage import Usage
    from pydantic import TypeAdapter
except ImportError as exc:  # pragma: no cover - only without the optional dependency
    raise ImportError(
        "agentops.client.openai_agents needs the OpenAI Agents SDK: "
        "pip install 'agentops[frameworks]' (or openai-agents)"
    ) from exc

from . import LookupFn, RemoteRun, ToolContext
from .routing import (
    CURRENT_CALL,
    Admitted,
    CallRouter,
    Outcome,
    OutcomeUndecided,
    Routed,
    current_call,
)

__all__ = [
    "STATE_KEY",
    "Outcome",
    "OutcomeUndecided",
    "RunParked",
    "current_call",
    "durable_tool",
    "run_agent",
]

# where an older version of this adapter kept the recorded model responses (the run's
# state): still read, so that a run it checkpointed resumes
STATE_KEY = "openai_agents"

_session: ContextVar[_Session | None] = ContextVar("agentops_openai_agents", default=None)
_output_items: TypeAdapter[list[TResponseOutputItem]] = TypeAdapter(list[TResponseOutputItem])


@dataclass
class _Session:
    router: CallRouter
    # the tool-calling model responses, in order: {"output": the response's items, "seq":
    # its checkpoint step}
    recorded: list[dict[str, Any]]
    turn: int = 0
    admitted: dict[str, Routed | Admitted] = field(default_factory=dict)
    pending: str = ""  # the SDK call id admitted and not yet carried out


def _session_of(name: str) -> _Session:
    session = _session.get()
    if session is None:
        raise RuntimeError(f"{name} is routed through agentops: run the agent with run_agent()")
    return session


def durable_tool(
    func: Callable[..., Any] | None = None,
    *,
    lookup: LookupFn | None = None,
    name: str | None = None,
    **function_tool_options: Any,
) -> Any:
    """Make ``func`` an SDK ``FunctionTool`` routed through the leased run of ``run_agent``:
    its ``needs_approval`` asks the run's gate, its invocation is dispatched and receipted.
    It must be declared under the same name in the agent's manifest. ``lookup``: the lookup
    by idempotency key of a ``reconcilable`` tool (``(key, arguments) -> Found``). The
    function raises ``agentops.client.ToolFailed`` for a definite failure and
    ``OutcomeUnknown`` (or anything else) when it cannot tell whether it acted."""
    if func is None:
        return lambda f: durable_tool(f, lookup=lookup, name=name, **function_tool_options)
    # the SDK's own schema and argument parsing; its errors reach us rather than the model
    inner: FunctionTool = function_tool(
        func, name_override=name, failure_error_function=None, **function_tool_options
    )

    def body_for(ctx: SdkToolContext[Any], loop: asyncio.AbstractEventLoop) -> Any:
        def body(arguments: Mapping[str, Any], call: ToolContext) -> Any:
            # an approver may have edited the arguments: always send the dispatched ones
            coroutine = _invoke(inner, ctx, json.dumps(dict(arguments)), call)
            return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

        return body

    async def needs_approval(ctx: RunContextWrapper[Any], params: dict[str, Any], call_id: str):
        session = _session_of(inner.name)
        if session.pending:
            # one open call at a time: this one is admitted when it is invoked
            return False
        admitted = await asyncio.to_thread(
            session.router.admit, inner.name, params, framework_call_id=call_id
        )
        session.admitted[call_id] = admitted
        if isinstance(admitted, Admitted):
            session.pending = call_id
        # parked: the SDK interrupts the run (the lease is already released)
        return isinstance(admitted, Routed) and admitted.status == "parked"

    async def invoke(ctx: SdkToolContext[Any], arguments: str) -> Any:
        session = _session_of(inner.name)
        router, loop = session.router, asyncio.get_running_loop()
        admitted = session.admitted.pop(ctx.tool_call_id, None)
        if admitted is None:
            admitted = await asyncio.to_thread(
                router.admit,
                inner.name,
                json.loads(arguments or "{}"),
                framework_call_id=ctx.tool_call_id,
            )
        if isinstance(admitted, Admitted):
            try:
                admitted = await asyncio.to_thread(
                    router.carry_out, admitted, body_for(ctx, loop), lookup=lookup
                )
            finally:
                if session.pending == ctx.tool_call_id:
                    session.pending = ""
        if admitted.status == "succeeded":
            return admitted.result
        if admitted.status == "parked":
            raise RunParked(admitted.detail)  # ends the SDK's run: run_agent reports it
        return f"{inner.name} {admitted.status}: {admitted.detail or admitted.result}"

    return FunctionTool(
        name=inner.name,
        description=inner.description,
        params_json_schema=inner.params_json_schema,
        on_invoke_tool=invoke,
        strict_json_schema=inner.strict_json_schema,
        needs_approval=needs_approval,
    )


async def _invoke(inner: FunctionTool, ctx: SdkToolContext[Any], arguments: str, call: ToolContext):
    token = CURRENT_CALL.set(call)
    try:
        result = inner.on_invoke_tool(ctx, arguments)
        return await result if inspect.isawaitable(result) else result
    finally:
        CURRENT_CALL.reset(token)


class RunParked(Exception):
    """A call's run needs a person (an unknown outcome nobody can look up): stop."""


class _Recorded(Model):
    """The agent's model, its tool-calling responses checkpointed (the history store) and
    replayed, in order, to a process that resumes the run."""

    def __init__(self, model: Model, session: _Session) -> None:
        self.model = model
        self.session = session

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        session = self.session
        turn, session.turn = session.turn, session.turn + 1
        if turn < len(session.recorded):
            recorded = session.recorded[turn]
            session.router.resume_from(recorded["seq"])
            output = _output_items.validate_python(recorded["output"])
            return ModelResponse(output=output, usage=Usage(), response_id=None)
        response = await self.model.get_response(*args, **kwargs)
        calls = [item for item in response.output if getattr(item, "type", "") == "function_call"]
        if calls:
            dumped = _output_items.dump_python(response.output, mode="json", exclude_none=True)

            recorded: list[dict[str, Any]] = []

            def responses_at(seq: int) -> list[dict[str, Any]]:
                recorded[:] = [*session.recorded, {"output": dumped, "seq": seq}]
                return recorded

            decided = [{"id": c.call_id, "tool": c.name, "arguments": c.arguments} for c in calls]
            await asyncio.to_thread(
                session.router.checkpoint, responses_at, {"tool_calls": decided}
            )
            session.recorded = recorded
            session.turn = len(session.recorded)
        return response

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("agentops.client.openai_agents runs agents with Runner.run")


def _model_of(agent: Agent[Any]) -> Model:
    if isinstance(agent.model, Model):
        return agent.model
    return MultiProvider().get_model(agent.model)


def run_agent(
    agent: Agent[Any],
    run: RemoteRun,
    input: str | list[Any],
    *,
    finish: bool = True,
    **kwargs: Any,
) -> Outcome:
    """Run (or resume) ``agent`` on the leased ``run`` with ``input`` (the same input each
    time: a resumed run replays its recorded responses from the start). ``finished``: the
    agent's final output, and with ``finish`` the run is finished with it; ``parked``: the
    run waits for a person (an approval, an unknown outcome) and the lease is released —
    exit, and run this again when the ``approval.decided`` webhook arrives. ``LeaseLost``
    propagates: stop. ``OutcomeUndecided`` (lookups could not tell whether a call acted)
    propagates too: the call stays unknown for a person to see."""
    router = CallRouter(run)
    saved = router.last_checkpoint()
    if saved is not None:
        recorded = saved[1]
    else:  # checkpointed in the state by an older version, or none yet
        recorded = list((run.resume.state.get(STATE_KEY) or {}).get("responses") or [])
    session = _Session(router, recorded)
    token = _session.set(session)
    try:
        durable = agent.clone(model=_Recorded(_model_of(agent), session))
        result = Runner.run_sync(durable, input, **kwargs)
    except Exception as exc:
        parked = session.router.parked
        if parked is None or not _caused_by(exc, RunParked):
            raise
        return Outcome("parked", None, parked.detail)
    finally:
        _session.reset(token)
    if result.interruptions:
        parked = session.router.parked
        return Outcome("parked", None, parked.detail if parked else "interrupted")
    output = result.final_output
    if hasattr(output, "model_dump"):
        output = output.model_dump(mode="json")
    if finish:
        run.finish(output)
    return Outcome("finished", output)


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
