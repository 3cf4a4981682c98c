"""Budgets and the dead letter: usage is never reset; an operator tops up or retries, and
each is recorded."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import transaction
from django.utils import timezone

from runs import engine
from runs.actors import Actor, PermissionDenied
from runs.models import Run
from runs.registry import CallTool
from runs.services import (
    BudgetExhausted,
    InvalidState,
    run_create,
    run_retry_recovery,
    run_topup_budget,
)
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, WorkerKilled, events, expire_lease, make_tool

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def olivia(operator) -> Actor:
    return Actor.for_user(operator, "web")


@pytest.fixture
def looping(register):
    """Reads forever; ``crash_on`` kills the worker at that (1-based) decision, once."""
    body = CountingTool()
    plan = {"crash_on": None, "decisions": 0}

    def decide(ctx):
        plan["decisions"] += 1
        if plan["decisions"] == plan["crash_on"]:
            plan["crash_on"] = None
            raise WorkerKilled
        return CallTool("budget_read", {})

    register(
        make_tool("budget_read", body), ScriptedAgent("budgeted", decide, tools=("budget_read",))
    )
    return body, plan


def test_topup_resumes_an_exhausted_run_and_usage_survives_a_restart(looping, olivia):
    body, plan = looping
    run = drive(run_create(agent_name="budgeted", actor=olivia, max_steps=3).id)
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")

    run = run_topup_budget(run_id=run.id, actor=olivia, add_steps=3)

    assert (run.status, run.reason_code, run.max_steps) == (Run.Status.QUEUED, "", 6)
    (topped,) = events(run.id, "run.budget_topped_up")
    assert topped.payload["before"]["max_steps"] == 3
    assert topped.payload["after"]["max_steps"] == 6
    assert topped.payload["usage"]["steps"] == 3
    assert topped.actor == "user:olivia"

    plan["crash_on"] = plan["decisions"] + 2  # one more step, then the worker dies
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")
    expire_lease(run.id)
    run = drive(run.id, worker="w2")

    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")
    assert run.steps_used == 6
    assert len(body.calls) == 6  # 3 + 3: neither the top-up nor the restart reset usage


def test_a_topup_that_leaves_the_budget_exhausted_is_refused(looping, olivia):
    run = drive(
        run_create(
            agent_name="budgeted", actor=olivia, deadline=timezone.now() - timedelta(minutes=1)
        ).id
    )
    assert run.reason_code == "budget_exhausted"

    with pytest.raises(BudgetExhausted) as refused, transaction.atomic():
        run_topup_budget(run_id=run.id, actor=olivia, add_steps=10)

    assert refused.value.code == "budget_exhausted"
    assert "deadline" in str(refused.value)
    run = run_topup_budget(
        run_id=run.id, actor=olivia, deadline=timezone.now() + timedelta(hours=1)
    )
    assert run.status == Run.Status.QUEUED


def test_limits_of_a_live_run_can_be_raised_without_changing_its_status(looping, olivia):
    run = run_create(agent_name="budgeted", actor=olivia, max_steps=2, max_cost=Decimal("1.50"))

    run = run_topup_budget(run_id=run.id, actor=olivia, add_steps=5, add_cost=Decimal("0.5"))

    assert (run.status, run.max_steps, run.max_cost) == (Run.Status.QUEUED, 7, Decimal("2.0"))
    assert run.steps_used == 0


def test_topup_is_refused_for_viewers_and_for_finished_runs(looping, olivia, viewer):
    run = drive(run_create(agent_name="budgeted", actor=olivia, max_steps=1).id)

    with pytest.raises(PermissionDenied), transaction.atomic():
        run_topup_budget(run_id=run.id, actor=Actor.for_user(viewer, "web"), add_steps=1)
    Run.objects.filter(id=run.id).update(status=Run.Status.FAILED)
    with pytest.raises(InvalidState), transaction.atomic():
        run_topup_budget(run_id=run.id, actor=olivia, add_steps=1)


def test_a_dead_lettered_run_can_be_retried_and_keeps_its_recovery_count(looping, olivia, settings):
    body, _ = looping
    limit = settings.AGENTOPS["MAX_RECOVERIES"]
    run = run_create(agent_name="budgeted", actor=olivia, max_steps=2)
    engine.claim(run.id, worker="w1")
    Run.objects.filter(id=run.id).update(recovery_count=limit)
    expire_lease(run.id)
    run = drive(run.id, worker="w2")
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "recovery_limit")
    assert body.calls == []

    run = run_retry_recovery(run_id=run.id, actor=olivia)

    assert (run.status, run.recovery_count) == (Run.Status.QUEUED, limit + 1)
    (retried,) = events(run.id, "run.recovery_retried")
    assert retried.payload["recovery_count"] == limit + 1
    # it crashes once more: the limit counts from the retry, so it goes on
    engine.claim(run.id, worker="w3")
    expire_lease(run.id)
    run = drive(run.id, worker="w4")
    assert run.recovery_count == limit + 2
    assert run.reason_code == "budget_exhausted"
    assert len(body.calls) == 2

    with pytest.raises(InvalidState), transaction.atomic():
        run_retry_recovery(run_id=run.id, actor=olivia)
