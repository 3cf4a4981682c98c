"""Helpers for the wait tests: agents that wait, and a clock moved on the record."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from runs.models import Question, Run, Step
from runs.registry import DecisionContext, Finish
from tests.support import ScriptedAgent


def waits_then_finishes(name: str, *waits: Any) -> ScriptedAgent:
    """Returns each wait in turn, then finishes with the outputs the waits ended with."""

    def decide(ctx: DecisionContext):
        if len(ctx.steps) < len(waits):
            return waits[len(ctx.steps)]
        return Finish(
            {"outputs": [s.output for s in ctx.steps], "errors": [s.error for s in ctx.steps]}
        )

    return ScriptedAgent(name, decide)


def fall_due(run_id: Any, seconds: float = 7 * 24 * 3600) -> None:
    """Move the open wait's timer or timeout (and the run's wake_at) that far into the past,
    as if that much time had gone by while no worker ran."""
    delta = timedelta(seconds=seconds)
    step = Step.objects.get(run_id=run_id, kind=Step.Kind.WAIT, status=Step.Status.PENDING)
    spec = dict(step.input)
    for key in ("deadline", "until"):
        if spec.get(key):
            spec[key] = (datetime.fromisoformat(spec[key]) - delta).isoformat()
    Step.objects.filter(id=step.id).update(input=spec)
    if spec.get("deadline"):
        expires_at = datetime.fromisoformat(spec["deadline"])
        Question.objects.filter(step=step).update(expires_at=expires_at)
    run = Run.objects.get(id=run_id)
    if run.wake_at is not None:
        Run.objects.filter(id=run_id).update(wake_at=run.wake_at - delta)


def assert_no_lease(run: Run) -> None:
    """Nothing holds the run while it waits: no worker, no lease to expire."""
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_EVENT
    assert run.lease_owner == ""
    assert run.lease_expires_at is None
