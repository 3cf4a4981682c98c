"""``python manage.py replay <run-id>``: would today's agent code decide what the record says?

Re-runs the agent's decisions against the recorded steps, one at a time: each decision is
compared with the recorded one, then the recorded outcome (never a new one) is fed back and
folded into the state with ``apply``, starting from the agent's initial state for the run's
input. No tool is called and nothing is written.

A model-backed agent (``runs.llm.LLMAgent``) is not asked again by default: each step's
recorded model answers (``step.decided`` payload ``answers``) go through today's mapping from
answer to action, so a change to that code, to the agent's tools or to what it accepts shows
up without a request. A step recorded without answers (before answers were recorded, or
decided by other code) is reported as "no recorded answer" and makes the replay inconclusive:
exit 3, since "identical" would claim something nobody checked. ``--live-model`` asks the
model again instead, with the conversation rebuilt from the record as ``decide`` builds it;
it still executes no tool and writes nothing (no pinning, no events).

Exit 0: identical; 3: diverged or not checked; 1: unknown run or agent, or ``--live-model``
without a model to ask.
"""

from __future__ import annotations

import sys
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from runs.llm import LLMAgent, ModelError, ModelUnavailable, ModelWithdrawn, call_records
from runs.models import Run, RunEvent, Step, ToolCall
from runs.record.eventtypes import EventType
from runs.record.transitions import step_view
from runs.registry import (
    Action,
    AskQuestion,
    CallTool,
    Decision,
    DecisionContext,
    Fail,
    Finish,
    Sleep,
    UnknownAgent,
    UnknownTool,
    WaitForSignal,
    mask,
    registry,
)

DIVERGED = 3


class Command(BaseCommand):
    help = "Replay a run's decisions with today's agent code; execute no tool."

    def add_arguments(self, parser):
        parser.add_argument("run_id")
        parser.add_argument(
            "--live-model",
            action="store_true",
            help=(
                "for a model-backed agent, ask the model again for every step instead of "
                "reusing its recorded answers (still executes no tool, writes nothing)"
            ),
        )

    def handle(self, *args: Any, run_id: str, live_model: bool = False, **options: Any) -> None:
        try:
            run = Run.objects.get(id=run_id)
        except (Run.DoesNotExist, ValidationError, ValueError):
            raise CommandError(f"no run {run_id}") from None
        try:
            agent = registry.agent(run.agent_name)
        except UnknownAgent:
            raise CommandError(
                f"agent {run.agent_name!r} of run {run_id} is not registered"
            ) from None
        model_backed = isinstance(agent, LLMAgent)
        if live_model:
            if not model_backed:
                raise CommandError(
                    f"--live-model: agent {run.agent_name!r} is not model-backed; "
                    "replay it without --live-model"
                )
            config = agent.config()
            model = run.model_id or config.model
            if not config.base_url or not model:
                raise CommandError(
                    "--live-model needs a model to ask: set AGENTOPS_LLM_BASE_URL and "
                    "AGENTOPS_LLM_MODEL"
                )
        steps = list(Step.objects.filter(run=run).order_by("seq"))
        calls = {c.step_id: c for c in ToolCall.objects.filter(run=run)}
        how = ""
        if model_backed:
            how = (
                f"; asking {model} again" if live_model else "; reusing the recorded model answers"
            )
        self.stdout.write(
            f"run {run.id}: {run.agent_name} recorded on version {run.agent_version}, "
            f"replayed on {agent.version}; {len(steps)} steps{how}"
        )
        answers = _recorded_answers(run) if model_backed and not live_model else {}
        records = call_records(run.id) if live_model else {}
        state = agent.initial_state(run.input)
        history: list = []
        diverged = unchecked = 0
        for step in steps:
            context = DecisionContext(
                run_id=str(run.id),
                goal=run.goal,
                input=run.input,
                state=state,
                steps=tuple(history),
            )
            action: Any
            if model_backed and not live_model:
                action = agent.action_from_answers(answers.get(step.seq, ()))
            elif live_model:
                # only the calls the model had seen when it decided this step
                seen = {seq: record for seq, record in records.items() if seq < step.seq}
                try:
                    action = agent.ask(
                        context,
                        seen,
                        config=config,
                        model=model,
                        max_output=config.max_output_tokens,
                    )
                except (ModelUnavailable, ModelError, ModelWithdrawn) as exc:
                    raise CommandError(
                        f"step {step.seq}: the model could not be asked: {exc}"
                    ) from None
            else:
                try:
                    action = agent.decide(context)
                except Exception as exc:
                    action = exc
            if isinstance(action, Decision):
                action = action.action  # an LLM agent's answer with its usage: compare the action
            if action is None:
                unchecked += 1
                self.stdout.write(
                    f"step {step.seq}: NOT CHECKED: no recorded answer "
                    f"({_describe_recorded(step)}); use --live-model to ask the model"
                )
            else:
                difference = _compare(
                    action, step, calls.get(step.id), masked=model_backed and not live_model
                )
                if difference:
                    diverged += 1
                    self.stdout.write(f"step {step.seq}: DIVERGED: {difference}")
                else:
                    self.stdout.write(f"step {step.seq}: same: {_describe_recorded(step)}")
            view = step_view(step)
            if step.status != Step.Status.PENDING:
                # the recorded outcome, exactly as the engine folded it
                state = agent.apply(dict(state), view)
            history.append(view)
        if diverged:
            self.stdout.write(f"diverged at {diverged} of {len(steps)} steps")
        if unchecked:
            self.stdout.write(f"{unchecked} of {len(steps)} steps not checked (no recorded answer)")
        if diverged or unchecked:
            sys.exit(DIVERGED)
        self.stdout.write("identical")


def _recorded_answers(run: Run) -> dict[int, list[Any]]:
    """Each step's recorded model answers, from its ``step.decided`` event."""
    answers: dict[int, list[Any]] = {}
    decided = RunEvent.objects.filter(run=run, type=EventType.STEP_DECIDED).values_list(
        "payload", flat=True
    )
    for payload in decided:
        recorded = payload.get("answers")
        if isinstance(recorded, list) and recorded and isinstance(payload.get("seq"), int):
            answers[payload["seq"]] = recorded
    return answers


def _describe_recorded(step: Step) -> str:
    if step.kind == Step.Kind.TOOL_CALL:
        return f"call {step.input.get('tool')} ({step.status})"
    if step.kind == Step.Kind.WAIT and step.input.get("wait") == "question":
        return f"ask {step.input.get('text', '')!r}"
    if step.kind == Step.Kind.WAIT and step.input.get("wait") == "signal":
        return f"wait for signal {step.input.get('name')!r}"
    if step.kind == Step.Kind.WAIT and step.input.get("wait") == "timer":
        return f"sleep until {step.input.get('until')}"
    return step.kind


def _tool_changed(name: str, call: ToolCall) -> str:
    """Today's tool is not the one the call was made with: retired, or changed to a
    fingerprint it does not declare compatible (``Tool.accepts``) — a resumed run would
    park or ask for approval again, so "identical" would be untrue."""
    try:
        tool = registry.tool(name)
    except UnknownTool:
        return f"tool {name} is retired (called on version {call.tool_version})"
    if not tool.accepts(call.tool_version):
        return (
            f"tool {name} changed: called on version {call.tool_version}, today's is {tool.version}"
        )
    return ""


def _describe_action(action: Any) -> str:
    if isinstance(action, CallTool):
        return f"call {action.tool}"
    if isinstance(action, Finish):
        return "finish"
    if isinstance(action, Fail):
        return "fail"
    if isinstance(action, AskQuestion):
        return f"ask {action.text!r}"
    if isinstance(action, Exception):
        return f"raise {type(action).__name__}: {action}"
    if isinstance(action, Action):
        return type(action).__name__
    return f"return {type(action).__name__} (not an action)"


def _masked(tool_name: str, arguments: Any) -> Any:
    try:
        return mask(arguments, registry.tool(tool_name).sensitive_fields)
    except (UnknownTool, AttributeError):
        return arguments


def _compare(action: Any, step: Step, call: ToolCall | None, *, masked: bool = False) -> str:
    """Empty when today's decision is the recorded one; else what would differ. ``masked``:
    the action came from a recorded model answer whose sensitive arguments were masked, so
    those are compared masked on both sides (their values were never recorded)."""
    recorded = _describe_recorded(step)
    if step.kind == Step.Kind.TOOL_CALL:
        if not isinstance(action, CallTool):
            return f"would {_describe_action(action)} instead of {recorded}"
        tool = step.input.get("tool")
        if action.tool != tool:
            return f"would call {action.tool} instead of {tool}"
        if call is None:
            return ""  # a call the engine refused: its arguments were not recorded
        changed = _tool_changed(tool, call)
        if changed:
            return changed
        now, then = _masked(tool, dict(action.arguments)), _masked(tool, call.arguments)
        if dict(action.arguments) == call.arguments or (masked and now == then):
            return ""
        changes = [
            f"{key} {now.get(key, '(absent)')} instead of {then.get(key, '(absent)')}"
            for key in sorted(set(now) | set(then))
            if now.get(key) != then.get(key)
        ]
        return f"would call {tool} with " + ", ".join(changes)
    if step.kind == Step.Kind.FINISH:
        if not isinstance(action, Finish):
            return f"would {_describe_action(action)} instead of finish"
        if action.result != step.input.get("result"):
            return f"would finish with {action.result!r} instead of {step.input.get('result')!r}"
        return ""
    if step.kind == Step.Kind.FAIL:
        if not isinstance(action, Fail):
            return f"would {_describe_action(action)} instead of fail"
        if action.reason != step.input.get("reason"):
            return f"would fail with {action.reason!r} instead of {step.input.get('reason')!r}"
        return ""
    if step.kind == Step.Kind.WAIT and step.input.get("refused"):
        # a wait the engine refused records only the kind of action decided
        if type(action).__name__ != step.input.get("wait"):
            return f"would {_describe_action(action)} instead of {step.input.get('wait')}"
        return ""
    if step.kind == Step.Kind.WAIT and step.input.get("wait") == "signal":
        if not isinstance(action, WaitForSignal):
            return f"would {_describe_action(action)} instead of {recorded}"
        if action.name != step.input.get("name"):
            return f"would wait for signal {action.name!r} instead of {step.input.get('name')!r}"
        if action.timeout_seconds != step.input.get("timeout_seconds"):
            return (
                f"would wait for signal {action.name!r} {action.timeout_seconds} s instead of "
                f"{step.input.get('timeout_seconds')} s"
            )
        if action.default != step.input.get("default"):
            return f"would default to {action.default!r} instead of {step.input.get('default')!r}"
        return ""
    if step.kind == Step.Kind.WAIT and step.input.get("wait") == "timer":
        if not isinstance(action, Sleep):
            return f"would {_describe_action(action)} instead of {recorded}"
        # ``Sleep(seconds=…)`` became a time when it was decided: only a fixed ``until`` can
        # be compared with the recorded one
        if action.until is not None and action.until.isoformat() != step.input.get("until"):
            return (
                f"would sleep until {action.until.isoformat()} instead of {step.input.get('until')}"
            )
        return ""
    if step.kind == Step.Kind.WAIT and step.input.get("wait") == "question":
        if not isinstance(action, AskQuestion):
            return f"would {_describe_action(action)} instead of {recorded}"
        choices = list(action.choices) if action.choices else None
        recorded_choices = list(step.input.get("choices") or []) or None
        if action.text != step.input.get("text") or choices != recorded_choices:
            return f"would ask {action.text!r} (choices {choices}) instead of {recorded}"
        if action.group != step.input.get("group"):
            return f"would ask group {action.group} instead of {step.input.get('group')}"
        return ""
    return f"cannot compare a {step.kind} step"
