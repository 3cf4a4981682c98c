"""The resume packet: what a process that claims a remote run's lease needs to continue it."""

from __future__ import annotations

from typing import Any

from runs.gate import GateView, get_gate
from runs.models import Question, Run, Signal, Step, ToolCall
from runs.remote.manifest import short_tool_name


def _call_data(run: Run, call: ToolCall, approvals: list[GateView]) -> dict[str, Any]:
    live = [approval.id for approval in approvals if approval.live]
    approval = live[-1] if live else None
    return {
        "id": call.id,
        "step_seq": call.step.seq,
        "tool": short_tool_name(run.agent_name, call.tool_name),
        "tool_version": call.tool_version,
        # the lease holder made these arguments and needs them to call or look up the tool
        "arguments": call.arguments,
        "status": call.status,
        "idempotency_key": call.idempotency_key,
        # the agent's own id for the call (its framework's), "" if it gave none
        "client_call_id": call.client_call_id,
        "attempt_count": call.attempt_count,
        "dispatched_at": call.dispatched_at.isoformat() if call.dispatched_at else None,
        "landing_deadline": call.landing_deadline.isoformat() if call.landing_deadline else None,
        # what a process that takes the call over acts on (issue 27): no byte of a request
        # after the send deadline; a lookup that may report the call absent begins after
        # ``resend_after`` (the landing deadline of a dispatched or unknown call)
        "send_deadline": call.send_deadline.isoformat() if call.send_deadline else None,
        "resend_after": (
            call.landing_deadline.isoformat()
            if call.landing_deadline
            and call.status in (ToolCall.Status.DISPATCHING, ToolCall.Status.UNKNOWN)
            else None
        ),
        "lookups_begun": call.lookups_begun,
        "last_error": call.last_error,
        "approval": approval,
    }


def wait_outcomes(steps: list[Step]) -> dict[int, dict[str, Any]]:
    """How each finished wait among ``steps`` ended (by step id), read from the record: the
    signal it consumed, its question's answer, its timer, or its timeout (the output is then
    the wait's declared default). Two queries, whatever the number of waits."""
    finished = {
        step.id: step
        for step in steps
        if step.kind == Step.Kind.WAIT and step.status == Step.Status.COMPLETED
    }
    if not finished:
        return {}
    signals = {
        signal.consumed_by_step_id: signal
        for signal in Signal.objects.filter(consumed_by_step_id__in=finished)
    }
    questions = {
        question.step_id: question
        for question in Question.objects.filter(step_id__in=finished).select_related("answered_by")
    }
    outcomes = {}
    for step_id, step in finished.items():
        kind = step.input.get("wait")
        signal, question = signals.get(step_id), questions.get(step_id)
        outcome: dict[str, Any] = {
            "kind": kind,
            "ended_by": "timeout",
            "timed_out": True,
            "signal_id": None,
            "question_id": question.id if question is not None else None,
            "answered_by": None,
        }
        if signal is not None:
            outcome.update(ended_by="signal", timed_out=False, signal_id=signal.id)
        elif question is not None and question.status == Question.Status.ANSWERED:
            outcome.update(
                ended_by="answer",
                timed_out=False,
                answered_by=question.answered_by.get_username() if question.answered_by else None,
            )
        elif kind == "timer":
            outcome.update(ended_by="timer", timed_out=False)
        outcomes[step_id] = outcome
    return outcomes


def resume_packet(run: Run) -> dict[str, Any]:
    """What a process needs to continue a run: state, completed steps (a wait with how it
    ended), open tool calls with their status, unknown outcomes to reconcile, approvals
    still pending."""
    steps = list(Step.objects.filter(run_id=run.id).order_by("seq"))
    ended_waits = wait_outcomes(steps)
    calls = list(
        ToolCall.objects.filter(run_id=run.id, status__in=ToolCall.OPEN)
        .select_related("step")
        .order_by("step__seq")
    )
    approvals = get_gate().approvals_of(call.id for call in calls) if calls else {}
    open_calls = [_call_data(run, call, approvals.get(call.id, [])) for call in calls]
    return {
        "run": str(run.id),
        "agent": run.agent_name,
        "agent_version": run.agent_version,
        "goal": run.goal,
        # a dry run (issue 23): the process calls no tool that is not read; it reports what
        # each would do, recorded as simulated (every dispatch answer says so again)
        "dry_run": run.dry_run,
        "input": run.input,
        "state": run.state,
        "state_version": run.state_version,
        "recovery_count": run.recovery_count,
        # the seq of the next step this process writes (pending steps count: they hold theirs)
        "next_seq": (steps[-1].seq + 1) if steps else 1,
        "steps": [
            {
                "seq": step.seq,
                "kind": step.kind,
                "status": step.status,
                "input": step.input,
                "output": step.output,
                "error": step.error,
                "wait": ended_waits.get(step.id),
            }
            for step in steps
            if step.status != Step.Status.PENDING
        ],
        "open_tool_calls": open_calls,
        "unknown_outcomes": [c for c in open_calls if c["status"] == ToolCall.Status.UNKNOWN],
        "pending_approvals": [
            {"id": c["approval"], "tool_call": c["id"]}
            for c in open_calls
            if c["status"] == ToolCall.Status.AWAITING_APPROVAL and c["approval"]
        ],
        "migrated_from": None,
        "migrations": [],
    }
