"""LLM-backed agents: ``decide`` through an OpenAI-compatible Chat Completions API with tool
calling (docs/agents.md, "LLM-backed agents"; configuration in docs/operations.md).

What the model sees is rebuilt from the record at every decision: the goal and input, the
step history as tool calls with their *real* outcomes (the tool call's status, a receipt's
source — a call resolved by an operator or by reconciliation says so), and last the run's
authoritative state with any open calls. Long histories are condensed: older steps become a
summary derived from the record each time (never stored, never in place of the record).

Durability comes from the engine, not from here: a decision is persisted as a step in the
``decided`` commit before anything acts on it, so a worker that dies after the model
answered resumes from that step and never asks the model again for it. The model is only
ever called outside any transaction (checked), with the lease renewed meanwhile; tokens and
cost of each decision are recorded on its step and added to the run's persisted usage in
that same commit (``runs.registry.Decision``), together with the model's answers
(``step.decided`` payload ``answers``, sensitive tool arguments masked) so ``manage.py
replay`` can check today's code against them without asking the model again. A run's model is
pinned when it is created (``Run.model_id``); when the agent's configured model changes later,
the agent's ``model_policy`` decides: ``"pin"`` keeps the run on its model, ``"follow"`` moves
it at its next claim (``run.model_changed``, runs/engine/loop.py).

Retries: 429, 5xx, timeouts and connection errors are retried with exponential backoff and
jitter (a ``Retry-After`` header is honoured); when they run out, or the API refuses the
key (401/403), the decision is postponed — the run is released and asked again later — and
never failed for an outage. A request the API rejects as malformed (other 4xx) fails the run
with ``agent_failed``: asking again would get the same answer.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connection

from runs import metrics
from runs.models import Run, ToolCall
from runs.record.checkpoint import checkpoint
from runs.record.eventtypes import EventType
from runs.registry import (
    Action,
    Agent,
    AskQuestion,
    CallTool,
    Decision,
    DecisionContext,
    DecisionPostponed,
    Fail,
    Finish,
    ModelWithdrawn,
    StepView,
    Tool,
    UnknownTool,
    Usage,
    mask,
    registry,
)

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

# functions every LLM agent offers besides its tools (names no registered tool may use)
FAIL_FUNCTION = "fail_run"
ASK_FUNCTION = "ask_person"
BUILTIN_FUNCTIONS = (FAIL_FUNCTION, ASK_FUNCTION)

# what an LLM agent does when its configured model changes under a running run
MODEL_POLICIES = ("pin", "follow")
# the Fail reason when the model's answer is unusable twice in a row (decide and replay agree)
UNUSABLE_TWICE = "the model's answer could not be used twice in a row: {problem}"

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
# the API refuses the key: a configuration problem an operator fixes, not the run's fault
CONFIG_STATUS = {401, 403}
_MILLION = Decimal(1_000_000)
_COST_QUANTUM = Decimal("0.000001")  # Run.cost_used has six decimal places


class ModelError(RuntimeError):
    """The API answered in a way asking again cannot fix (a malformed request, a response
    without a choice): the run fails with ``agent_failed`` and this message."""


class ModelUnavailable(DecisionPostponed):
    """The API did not answer usefully within the retries: decide again later."""


class ModelCallInTransaction(RuntimeError):
    """A model call was about to be made while a transaction is open (never allowed: it
    would hold row locks for seconds)."""


@dataclass(frozen=True)
class LLMConfig:
    base_url: str
    api_key: str
    model: str
    timeout: float
    decision_timeout: float
    max_retries: int
    backoff: float
    max_backoff: float
    postpone: float
    input_price: Decimal
    output_price: Decimal
    max_output_tokens: int
    history_steps: int

    @classmethod
    def from_settings(cls) -> LLMConfig:
        conf = settings.AGENTOPS_LLM
        return cls(
            base_url=conf["BASE_URL"].rstrip("/"),
            api_key=conf["API_KEY"],
            model=conf["MODEL"],
            timeout=conf["TIMEOUT"],
            decision_timeout=conf["DECISION_TIMEOUT"],
            max_retries=conf["MAX_RETRIES"],
            backoff=conf["BACKOFF"],
            max_backoff=conf["MAX_BACKOFF"],
            postpone=conf["POSTPONE"],
            input_price=Decimal(conf["INPUT_PRICE"]),
            output_price=Decimal(conf["OUTPUT_PRICE"]),
            max_output_tokens=conf["MAX_OUTPUT_TOKENS"],
            history_steps=conf["HISTORY_STEPS"],
        )

    def cost(self, prompt_tokens: int, completion_tokens: int) -> Decimal:
        cost = (
            Decimal(prompt_tokens) * self.input_price
            + Decimal(completion_tokens) * self.output_price
        ) / _MILLION
        return cost.quantize(_COST_QUANTUM, rounding=ROUND_HALF_UP)


# --- the API client -------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    message: Mapping[str, Any]
    prompt_tokens: int
    completion_tokens: int
    model: str
    response_id: str
    attempts: int


def _in_transaction() -> bool:
    # Atomic blocks a test case opened around the whole test are not the code's own
    # transactions (Django marks them the same way for its durable=True check).
    return any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)


def _observe(sent: float, outcome: str) -> None:
    metrics.MODEL_REQUEST_SECONDS.labels(outcome=outcome).observe(time.monotonic() - sent)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "")
    try:
        seconds = float(value)
    except ValueError:
        return None  # an HTTP date, or nothing: use our own backoff
    return max(seconds, 0.0)


def _model_gone(response: Any) -> bool:
    """The API says the requested model does not exist: HTTP 404 (OpenAI's answer for an
    unknown or withdrawn model), or an error whose code is ``model_not_found`` (some
    compatible servers answer 400 with it)."""
    if response.status_code == 404:
        return True
    if response.status_code != 400:
        return False
    try:
        error = response.json().get("error") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "model_not_found"


def _backoff(config: LLMConfig, attempt: int) -> float:
    """Exponential backoff with jitter: half of it fixed, half random, so many workers
    retrying after one outage do not come back in step."""
    ceiling = min(config.max_backoff, config.backoff * (2 ** (attempt - 1)))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


class ChatClient:
    """POST ``{base_url}/chat/completions`` with retries. ``sleep`` is injectable for tests
    that want to see the backoff without waiting for it."""

    def __init__(self, config: LLMConfig, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self.sleep = sleep

    def complete(self, body: Mapping[str, Any]) -> Completion:
        if _in_transaction():
            raise ModelCallInTransaction(
                "an LLM call must not be made inside a transaction (it would hold locks)"
            )
        config = self.config
        if not config.base_url:
            raise ModelError("AGENTOPS_LLM_BASE_URL is not set: no model API to ask")
        headers = {"Content-Type": "application/json"}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        started = time.monotonic()
        attempt = 0
        last_problem = ""
        import httpx  # here: a worker that never asks a model starts faster without it

        with httpx.Client(base_url=config.base_url, headers=headers) as client:
            while True:
                attempt += 1
                remaining = config.decision_timeout - (time.monotonic() - started)
                if remaining <= 0:
                    break
                retry_after: float | None = None
                sent = time.monotonic()
                try:
                    response = client.post(
                        "/chat/completions",
                        json=body,
                        timeout=httpx.Timeout(
                            min(config.timeout, remaining), connect=min(10.0, remaining)
                        ),
                    )
                except httpx.TimeoutException as exc:
                    _observe(sent, "timeout")
                    last_problem = f"timed out ({type(exc).__name__})"
                except httpx.TransportError as exc:
                    _observe(sent, "connection_error")
                    last_problem = f"connection failed: {exc}"
                else:
                    _observe(sent, str(response.status_code))
                    if response.status_code == 200:
                        return self._parse(response, attempts=attempt)
                    detail = response.text[:500]
                    if response.status_code in CONFIG_STATUS:
                        log.error(
                            "model API refused the credentials (HTTP %s): %s",
                            response.status_code,
                            detail,
                        )
                        raise ModelUnavailable(
                            f"model API refused the credentials (HTTP {response.status_code}): "
                            f"{detail}; check AGENTOPS_LLM_API_KEY",
                            retry_after=config.postpone,
                        )
                    if _model_gone(response):
                        raise ModelWithdrawn(
                            f"model {body.get('model')!r} is not available from the model API "
                            f"(HTTP {response.status_code}): {detail}"
                        )
                    if response.status_code not in RETRYABLE_STATUS:
                        raise ModelError(
                            f"model API rejected the request (HTTP {response.status_code}): "
                            f"{detail}"
                        )
                    last_problem = f"HTTP {response.status_code}: {detail}"
                    retry_after = _retry_after(response)
                if attempt > config.max_retries:
                    break
                delay = _backoff(config, attempt)
                if retry_after is not None:
                    delay = min(max(delay, retry_after), config.max_backoff)
                if time.monotonic() - started + delay >= config.decision_timeout:
                    break
                log.warning(
                    "model API attempt %d failed (%s); retrying in %.2fs",
                    attempt,
                    last_problem,
                    delay,
                )
                self.sleep(delay)
        raise ModelUnavailable(
            f"model API unavailable after {attempt} attempt(s): {last_problem}",
            retry_after=config.postpone,
        )

    @staticmethod
    def _parse(response: httpx.Response, *, attempts: int) -> Completion:
        try:
            data = response.json()
            message = data["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ModelError(
                f"model API answered without a message ({type(exc).__name__}): "
                f"{response.text[:300]}"
            ) from None
        usage = data.get("usage") or {}
        return Completion(
            message=message,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            model=str(data.get("model") or ""),
            response_id=str(data.get("id") or ""),
            attempts=attempts,
        )


# --- tools and history as the model sees them ---------------------------------------------------


def tool_schema(tool: Tool) -> dict[str, Any]:
    """A registered tool as a Chat Completions function: its JSON schema is the parameters."""
    policy = tool.approval.describe()
    notes = [f"effect: {tool.effect}"]
    if policy != "never":
        notes.append(f"needs a person's approval: {policy}")
    description = (tool.description or tool.name).strip()
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": f"{description} ({'; '.join(notes)})",
            "parameters": dict(tool.schema),
        },
    }


BUILTIN_SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": FAIL_FUNCTION,
            "description": "Give up: the goal cannot be reached. The run ends as failed.",
            "parameters": {
                "type": "object",
                "properties": {"reason": {"type": "string", "minLength": 1}},
                "required": ["reason"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": ASK_FUNCTION,
            "description": (
                "Ask a person (an operator) a question and wait for the answer. Offer "
                "choices when the answer is one of a few options."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "question": {"type": "string", "minLength": 1},
                    "choices": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["question"],
                "additionalProperties": False,
            },
        },
    },
]


def _json(value: Any, limit: int | None = None) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    if limit is not None and len(text) > limit:
        return text[:limit] + f"… ({len(text) - limit} more characters)"
    return text


@dataclass(frozen=True)
class CallRecord:
    """A tool call's real status from the record (not only its step's)."""

    status: str
    receipt_source: str
    attempts: int


def call_records(run_id: Any) -> dict[int, CallRecord]:
    rows = ToolCall.objects.filter(run_id=run_id).values_list(
        "step__seq", "status", "receipt__source", "attempt_count"
    )
    return {
        seq: CallRecord(status=status, receipt_source=source or "", attempts=attempts)
        for seq, status, source, attempts in rows
    }


def _step_outcome(step: StepView, record: CallRecord | None) -> dict[str, Any]:
    outcome: dict[str, Any] = {"step": step.seq, "step_status": step.status}
    if record is not None:
        outcome["call_status"] = record.status
        if record.receipt_source and record.receipt_source != "tool":
            # e.g. "reconciliation" (looked up after a crash) or "operator" (a person said)
            outcome["outcome_recorded_by"] = record.receipt_source
    if step.status == "completed":
        outcome["result"] = step.output
    elif step.status == "failed":
        outcome["error"] = step.error
    return outcome


def _call_id(step: StepView) -> str:
    return f"step_{step.seq}"


def _as_function_call(step: StepView) -> tuple[str, dict[str, Any]] | None:
    """The function call a step corresponds to, as the model made it; None for a step that
    is not one of the model's calls (a wait some other code made)."""
    if step.kind == "tool_call":
        arguments = step.input.get("arguments")
        return str(step.input.get("tool", "")), arguments if isinstance(arguments, dict) else {}
    if step.kind == "wait" and step.input.get("wait") == "question":
        arguments = {"question": step.input.get("text", "")}
        if step.input.get("choices"):
            arguments["choices"] = list(step.input["choices"])
        return ASK_FUNCTION, arguments
    return None


def condense(steps: Sequence[StepView], records: Mapping[int, CallRecord]) -> str:
    """One line per older step, derived from the record (recomputed at every decision)."""
    lines = []
    for step in steps:
        call = _as_function_call(step)
        what = (
            f"{call[0]}({_json(call[1], 200)})" if call else f"{step.kind} {_json(step.input, 200)}"
        )
        record = records.get(step.seq)
        status = record.status if record else step.status
        result = _json(step.output, 200) if step.status == "completed" else step.error[:200]
        lines.append(f"- step {step.seq}: {what} -> {status}: {result}")
    return "\n".join(lines)


# --- the agent ---------------------------------------------------------------------------------


class LLMAgent(Agent):
    """An agent whose decisions a language model makes. Subclass it with a ``name``,
    ``version``, ``tools``, ``input_schema`` and ``instructions`` (the system prompt).

    The model answers with one tool call (the first is used; ``parallel_tool_calls`` is
    off), ``fail_run``, ``ask_person``, or plain text — which finishes the run with
    ``{"answer": text}``.
    """

    instructions: str = "You are a careful assistant that completes the user's goal."
    # who answers ask_person, and how long they have
    question_group: str = "operator"
    question_ttl_seconds: float = 24 * 3600
    # the engine renews the lease while decide() runs (a model call takes seconds)
    slow_decide = True
    # "pin": a run keeps the model it started with; "follow": a run moves to the agent's
    # configured model at its next claim, recorded as run.model_changed (runs/engine/loop.py)
    model_policy: str = "pin"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # a typo here would silently mean "pin": refuse it when the class is defined
        if cls.model_policy not in MODEL_POLICIES:
            raise TypeError(
                f"{cls.__name__}.model_policy must be one of {MODEL_POLICIES}, "
                f"not {cls.model_policy!r}"
            )

    def __init__(self, *, client_factory: Callable[[LLMConfig], ChatClient] | None = None):
        self._client_factory = client_factory or ChatClient

    def config(self) -> LLMConfig:
        return LLMConfig.from_settings()

    def model_for_new_run(self) -> str:
        return self.config().model

    # -- what the model is told --

    def system_prompt(self) -> str:
        return (
            f"{self.instructions.strip()}\n\n"
            "You act through the functions you are given, one call at a time; each call's "
            "result comes back before you decide again. Calls with side effects are recorded "
            "and may wait for a person's approval. When the goal is reached, reply with a "
            "short final answer and no function call. If it cannot be reached, call "
            f"{FAIL_FUNCTION}. To let a person decide something, call {ASK_FUNCTION}. The "
            "last message always holds the run's authoritative state: trust it over anything "
            "earlier in the conversation."
        )

    def tool_schemas(self) -> list[dict[str, Any]]:
        # a registered tool of the same name as a built-in wins (function names are unique)
        builtins = [b for b in BUILTIN_SCHEMAS if b["function"]["name"] not in self.tools]
        return [tool_schema(registry.tool(name)) for name in self.tools] + builtins

    def messages(
        self, ctx: DecisionContext, records: Mapping[int, CallRecord], history_steps: int
    ) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.system_prompt()},
            {
                "role": "user",
                "content": f"Goal: {ctx.goal or '(none given)'}\nInput: {_json(ctx.input)}",
            },
        ]
        steps = [step for step in ctx.steps if step.kind not in ("finish", "fail")]
        older, recent = (
            (steps[:-history_steps], steps[-history_steps:])
            if history_steps > 0 and len(steps) > history_steps
            else ([], steps)
        )
        if older:
            messages.append(
                {
                    "role": "user",
                    "content": (
                        f"Earlier steps, condensed ({len(older)} steps; the record keeps them "
                        "in full):\n" + condense(older, records)
                    ),
                }
            )
        for step in recent:
            call = _as_function_call(step)
            outcome = _step_outcome(step, records.get(step.seq))
            if call is None:
                messages.append(
                    {"role": "user", "content": f"Step {step.seq} ({step.kind}): {_json(outcome)}"}
                )
                continue
            name, arguments = call
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": _call_id(step),
                            "type": "function",
                            "function": {"name": name, "arguments": _json(arguments)},
                        }
                    ],
                }
            )
            messages.append(
                {"role": "tool", "tool_call_id": _call_id(step), "content": _json(outcome)}
            )
        open_calls = [
            {"step": seq, "status": record.status, "attempts": record.attempts}
            for seq, record in sorted(records.items())
            if record.status in ToolCall.OPEN
        ]
        messages.append(
            {
                "role": "user",
                "content": "Authoritative state of this run (from its record):\n"
                + _json(
                    {"state": ctx.state, "steps_taken": len(ctx.steps), "open_calls": open_calls}
                ),
            }
        )
        return messages

    # -- deciding --

    def decide(self, ctx: DecisionContext) -> Action | Decision:
        config = self.config()
        run = Run.objects.filter(id=ctx.run_id).values("model_id", "max_tokens", "tokens_used")[0]
        model = run["model_id"] or self._pin_model(ctx.run_id, config.model)
        max_output = config.max_output_tokens
        if run["max_tokens"] is not None:
            # never ask for more than the token budget still allows
            max_output = max(1, min(max_output, run["max_tokens"] - run["tokens_used"]))
        return self.ask(
            ctx, call_records(ctx.run_id), config=config, model=model, max_output=max_output
        )

    def decision_maximum(self, run: Run) -> Usage:
        """A decision's declared maximum (runs.spend): two requests — the answer and one
        correction — each of at most ``MAX_PROMPT_TOKENS`` in and the output ``decide``
        asks for out, priced as configured. Reserved before the model is asked, so a request
        a crash cuts off is counted; settled at the model's real usage."""
        config = self.config()
        output = config.max_output_tokens
        if run.max_tokens is not None:
            output = max(1, min(output, run.max_tokens - run.tokens_used))
        prompt = settings.AGENTOPS_LLM.get("MAX_PROMPT_TOKENS", 16000)
        return Usage(tokens=2 * (prompt + output), cost=config.cost(2 * prompt, 2 * output))

    def ask(
        self,
        ctx: DecisionContext,
        records: Mapping[int, CallRecord],
        *,
        config: LLMConfig,
        model: str,
        max_output: int,
    ) -> Decision:
        """Ask ``model`` for the decision ``ctx`` calls for; writes nothing (``decide`` pins
        the model first; ``manage.py replay --live-model`` calls this directly)."""
        messages = self.messages(ctx, records, config.history_steps)
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "tools": self.tool_schemas(),
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "max_tokens": max_output,
        }
        client = self._client_factory(config)
        completions = [client.complete(body)]
        action, problem = self._action(completions[-1].message)
        if problem:
            # one correction: tell the model what was wrong and let it call again
            body["messages"] = [
                *messages,
                dict(completions[-1].message),
                *self._corrections(completions[-1].message, problem),
            ]
            completions.append(client.complete(body))
            action, problem = self._action(completions[-1].message)
            if problem:
                action = Fail(UNUSABLE_TWICE.format(problem=problem))
        prompt = sum(c.prompt_tokens for c in completions)
        completion = sum(c.completion_tokens for c in completions)
        usage = Usage(
            tokens=prompt + completion,
            cost=config.cost(prompt, completion),
            detail={
                "model": model,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "requests": sum(c.attempts for c in completions),
                "response_ids": [c.response_id for c in completions if c.response_id],
            },
            answers=tuple(self.recordable_answer(c.message) for c in completions),
        )
        return Decision(action=action, usage=usage)

    def recordable_answer(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """The part of a model message that decides the action, as it may be recorded.

        The event record is append-only and hash-chained: a secret written there can never
        be removed. So the arguments of a call to a tool with ``sensitive_fields`` are masked
        the way every other event masks them. The trade-off: replaying a recorded answer
        sees ``***`` for those fields, so replay compares them masked and cannot tell
        whether today's code would pass a different value there (``--live-model`` can).
        Unparseable arguments of such a tool are withheld (they cannot be masked); they
        stay unparseable, so replay still sees the same problem."""
        answer: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        calls = []
        for call in message.get("tool_calls") or []:
            if not isinstance(call, Mapping):
                continue
            function = call.get("function") or {}
            name = str(function.get("name") or "")
            raw = function.get("arguments") or "{}"
            sensitive = self._sensitive_fields(name)
            if sensitive:
                try:
                    parsed = json.loads(raw) if isinstance(raw, str) else raw
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    raw = json.dumps(mask(parsed, sensitive))
                elif isinstance(raw, str):
                    raw = f"<withheld: {len(raw)} characters of unparseable arguments>"
                else:
                    raw = "<withheld: arguments that are not a JSON object>"
            calls.append(
                {
                    "id": str(call.get("id") or ""),
                    "type": "function",
                    "function": {"name": name, "arguments": raw},
                }
            )
        if calls:
            answer["tool_calls"] = calls
        return answer

    @staticmethod
    def _sensitive_fields(tool_name: str) -> tuple[str, ...]:
        try:
            return tuple(registry.tool(tool_name).sensitive_fields)
        except UnknownTool:
            return ()

    def action_from_answers(self, answers: Sequence[Mapping[str, Any]]) -> Action | None:
        """What today's code makes of recorded answers, exactly as ``ask`` would have: the
        first usable one, one correction at most. None when today's code would have needed
        an answer that was never recorded (it rejects one the recorded run accepted)."""
        if not answers:
            return None
        action, problem = self._action(answers[0])
        if not problem:
            return action
        if len(answers) < 2:
            return None
        action, problem = self._action(answers[1])
        return Fail(UNUSABLE_TWICE.format(problem=problem)) if problem else action

    def _pin_model(self, run_id: str, model: str) -> str:
        """A run created before its agent used a model (or by code that did not pin one):
        pinned now, once, with an event; whoever pins first wins."""
        with checkpoint(run_id, actor=f"agent:{self.name}", channel="worker") as cp:
            if Run.objects.filter(id=run_id, model_id="").update(model_id=model):
                cp.event(EventType.RUN_MODEL_PINNED, model=model)
        return Run.objects.filter(id=run_id).values_list("model_id", flat=True)[0]

    def _action(self, message: Mapping[str, Any]) -> tuple[Action | None, str]:
        """The action a message asks for, or a problem to tell the model about."""
        calls = message.get("tool_calls") or []
        if not calls:
            content = message.get("content")
            if isinstance(content, list):  # content parts
                content = "".join(
                    part.get("text", "") for part in content if isinstance(part, dict)
                )
            content = (content or "").strip()
            if not content:
                return None, "the answer was empty: call a function or give a final answer"
            return Finish({"answer": content}), ""
        function = calls[0].get("function") or {}
        name = str(function.get("name") or "")
        raw = function.get("arguments") or "{}"
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError as exc:
            return None, f"the arguments of {name} were not valid JSON ({exc})"
        if not isinstance(arguments, dict):
            return None, f"the arguments of {name} must be a JSON object"
        if name in self.tools:
            # arguments that do not match the schema are refused by the engine as a failed
            # step the model sees at its next decision
            return CallTool(name, arguments), ""
        if name == FAIL_FUNCTION:
            return Fail(str(arguments.get("reason") or "the model gave up")), ""
        if name == ASK_FUNCTION:
            question = str(arguments.get("question") or "").strip()
            if not question:
                return None, f"{ASK_FUNCTION} needs a question"
            choices = arguments.get("choices") or None
            return (
                AskQuestion(
                    text=question,
                    choices=[str(choice) for choice in choices] if choices else None,
                    group=self.question_group,
                    ttl_seconds=self.question_ttl_seconds,
                ),
                "",
            )
        # a tool the agent may not use: the engine refuses it as a failed step the model
        # sees at its next decision
        return CallTool(name, arguments), ""

    @staticmethod
    def _corrections(message: Mapping[str, Any], problem: str) -> list[dict[str, Any]]:
        text = f"Your last answer could not be used: {problem}. Answer again."
        calls = message.get("tool_calls") or []
        # every tool call in an assistant message needs an answer before the next message
        return [
            {"role": "tool", "tool_call_id": call.get("id", ""), "content": text} for call in calls
        ] or [{"role": "user", "content": text}]
