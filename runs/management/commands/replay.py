"""``python manage.py replay <run-id>``: would today's agent code decide what the record says?

Re-runs the agent's ``decide`` against the recorded steps, one at a time: each decision is
compared with the recorded one, then the recorded outcome (never a new one) is fed back and
folded into the state with ``apply``, starting from the agent's initial state for the run's
input. No tool is called and nothing is written. Exit 0: identical; 3: diverged; 1: the run
or its agent is unknown.
"""

from __future__ import annotations

import sys
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from runs.models import Run, Step, ToolCall
from runs.registry import (
    CallTool,
    Decision,
    DecisionContext,
    Fail,
    Finish,
    UnknownAgent,
    UnknownTool,
    mask,
    registry,
)
from runs.transitions import step_view

DIVERGED = 3


class Command(BaseCommand):
    help = "Replay a run's decisions with today's agent code; execute no tool."

    def add_arguments(self, parser):
        parser.add_argument("run_id")

    def handle(self, *args: Any, run_id: str, **options: Any) -> None:
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
        steps = list(Step.objects.filter(run=run).order_by("seq"))
        calls = {c.step_id: c for c in ToolCall.objects.filter(run=run)}
        self.stdout.write(
            f"run {run.id}: {run.agent_name} recorded on version {run.agent_version}, "
            f"replayed on {agent.version}; {len(steps)} steps"
        )
        state = agent.initial_state(run.input)
        history: list = []
        diverged = 0
        for step in steps:
            context = DecisionContext(
                run_id=str(run.id),
                goal=run.goal,
                input=run.input,
                state=state,
                steps=tuple(history),
            )
            try:
                action = agent.decide(context)
            except Exception as exc:
                action = exc
            if isinstance(action, Decision):
                action = action.action  # an LLM agent's answer with its usage: compare the action
            difference = _compare(action, step, calls.get(step.id))
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
            sys.exit(DIVERGED)
        self.stdout.write("identical")


def _describe_recorded(step: Step) -> str:
    if step.kind == Step.Kind.TOOL_CALL:
        return f"call {step.input.get('tool')} ({step.status})"
    return step.kind


def _describe_action(action: Any) -> str:
    if isinstance(action, CallTool):
        return f"call {action.tool}"
    if isinstance(action, Finish):
        return "finish"
    if isinstance(action, Fail):
        return "fail"
    if isinstance(action, Exception):
        return f"raise {type(action).__name__}: {action}"
    return f"return {type(action).__name__} (not an action)"


def _masked(tool_name: str, arguments: Any) -> Any:
    try:
        return mask(arguments, registry.tool(tool_name).sensitive_fields)
    except (UnknownTool, AttributeError):
        return arguments


def _compare(action: Any, step: Step, call: ToolCall | None) -> str:
    """Empty when today's decision is the recorded one; else what would differ."""
    recorded = _describe_recorded(step)
    if step.kind == Step.Kind.TOOL_CALL:
        if not isinstance(action, CallTool):
            return f"would {_describe_action(action)} instead of {recorded}"
        tool = step.input.get("tool")
        if action.tool != tool:
            return f"would call {action.tool} instead of {tool}"
        if call is None:
            return ""  # a call the engine refused: its arguments were not recorded
        if dict(action.arguments) == call.arguments:
            return ""
        now, then = _masked(tool, dict(action.arguments)), _masked(tool, call.arguments)
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
    return f"cannot compare a {step.kind} step"
