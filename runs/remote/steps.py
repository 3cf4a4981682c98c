"""A remote agent's own checkpointed decisions (``remote_step_record``) and the end of its run
(``remote_run_finish``); the replay rules a retried step or wait follows (``seq``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db.models import F

from runs import engine, spend
from runs.actors import Actor
from runs.models import Run, Step
from runs.record import transitions
from runs.record.eventtypes import EventType
from runs.registry import digest
from runs.remote.lease import (
    RemoteLease,
    _check_budget,
    _held,
    _require_remote,
    honour_request,
    lease_holder_check,
)
from runs.services import BudgetExhausted, InvalidInput, InvalidState

DECISION = Step.Kind.DECISION  # the Step kind of a remote agent's own checkpointed decision


def _replayed_step(
    run_id: Any, fence: int, seq: int, kind: str, same: Callable[[Step], bool]
) -> Step | None:
    """A retried request whose first commit went through but whose answer was lost: the
    step this incarnation already recorded at ``seq``, if it is the same decision."""
    step = Step.objects.filter(run_id=run_id, seq=seq, incarnation=fence, kind=kind).first()
    return step if step is not None and same(step) else None


def _next_seq(lease: RemoteLease, expected: int | None) -> int:
    seq = (lease.steps[-1].seq + 1) if lease.steps else 1
    if expected is not None and expected != seq:
        raise InvalidState(f"the run's next step is {seq}, not {expected}")
    return seq


@dataclass(frozen=True)
class StepRecorded:
    step: Step
    replayed: bool  # a retried request: the step its first attempt recorded


def remote_step_record(
    *,
    run_id: Any,
    fence: int,
    lease_token: str,
    actor: Actor,
    input: Any = None,
    output: Any = None,
    state: Any = None,
    cost: Any = 0,
    tokens: int = 0,
    seq: int | None = None,
) -> StepRecorded:
    """``decided`` + ``step_completed`` for the process's own work (a model call, a plan):
    the step, its usage and the new state in one commit, so a successor resumes after it.

    ``seq`` (optional) is the step number the process expects: a retry of a request that
    was recorded (same fence, seq, input and output) returns that step and records nothing;
    any other ``seq`` than the next one is ``InvalidState``. Without it every request is a
    new step (two identical decisions in a row may be meant)."""
    input = input if input is not None else {}
    if seq is not None:
        _require_remote(run_id, actor)
        lease_holder_check(run_id, fence, actor, lease_token)
        replayed = _replayed_step(
            run_id,
            fence,
            seq,
            DECISION,
            lambda step: (
                digest(step.input) == digest(input) and digest(step.output) == digest(output)
            ),
        )
        if replayed is not None:
            return StepRecorded(replayed, True)
    lease = _held(run_id, fence, actor, lease_token)
    honour_request(lease)
    if lease.open_step() is not None:
        raise InvalidState("a tool call step is still open: record its receipt first")
    seq = _next_seq(lease, seq)
    _check_budget(lease)
    stopped = spend.stop_if_full(lease)
    if stopped:
        raise BudgetExhausted(stopped + "; the run now needs a person (a top-up of the scope)")
    with lease.checkpoint() as cp:
        step = transitions.step_ended(
            run_id, seq=seq, kind=DECISION, incarnation=fence, input=input
        )
        step.output, step.cost, step.tokens = output, cost or 0, tokens or 0
        step.save(force_insert=True)
        cp.event(EventType.STEP_DECIDED, seq=seq, kind=DECISION, cost=cost, tokens=tokens)
        updates: dict[str, Any] = {
            "steps_used": F("steps_used") + 1,
            "cost_used": F("cost_used") + (cost or 0),
            "tokens_used": F("tokens_used") + (tokens or 0),
        }
        if state is not None:
            updates.update(state=state, state_version=F("state_version") + 1)
        cp.update(**updates)
        # the scopes a spend cap covers count it too (reported after the fact, not reserved)
        spend.charge_reported(cp, run=lease.run, cost=cost, tokens=tokens)
        cp.boundary("decided")
        cp.boundary("step_completed")
    return StepRecorded(step, False)


def remote_run_finish(
    *,
    run_id: Any,
    fence: int,
    lease_token: str,
    actor: Actor,
    status: str = Run.Status.SUCCEEDED,
    result: Any = None,
    reason: str = "",
) -> Run:
    """``run_finished``: the process ends the run, succeeded (with a result) or failed (with
    a reason); the lease is released with it."""
    if status not in (Run.Status.SUCCEEDED, Run.Status.FAILED):
        raise InvalidInput("status must be succeeded or failed")
    if status == Run.Status.FAILED and not (reason or "").strip():
        raise InvalidInput("a failed run needs a reason")
    lease = _held(run_id, fence, actor, lease_token)
    honour_request(lease)
    if lease.open_step() is not None:
        raise InvalidState("a tool call step is still open: record its receipt first")
    seq = (lease.steps[-1].seq + 1) if lease.steps else 1
    if status == Run.Status.SUCCEEDED:
        engine.finish(lease, status, result=result, seq=seq)
    else:
        engine.finish(lease, status, reason=Run.Reason.AGENT_FAILED, detail=reason, seq=seq)
    return Run.objects.get(id=run_id)
