"""The state machine (runs.record.machine), checked at the write: every allowed move of a
run, a step and a call goes through the real checkpoint; every forbidden one raises and
writes nothing (no status, no event)."""

from __future__ import annotations

import itertools

import pytest
from django.db import transaction

from runs.models import Run, RunEvent, Step, ToolCall
from runs.record import machine, transitions
from runs.record.checkpoint import checkpoint
from runs.registry import registry
from runs.services import run_create

pytestmark = [pytest.mark.usefixtures("roles"), pytest.mark.django_db]

RUN_STATUSES = list(Run.Status.values)
CALL_STATUSES = list(ToolCall.Status.values)
STEP_STATUSES = list(Step.Status.values)


def _run(actor, status: str) -> Run:
    run = run_create(
        agent_name="refund", input={"order_id": "ord_1001", "amount_cents": 500}, actor=actor
    )
    Run.objects.filter(id=run.id).update(status=status)
    return Run.objects.get(id=run.id)


def _reason_for(status: str) -> str:
    return min(machine.RUN_REASONS.get(status, {""}))


def _move(run: Run, status: str, reason: str) -> None:
    with checkpoint(run.id, actor="test", channel="cli") as cp:
        cp.event("run.moved", to=status)
        cp.update(status=status, reason_code=reason)


def test_the_tables_name_every_status_and_only_statuses():
    for table, statuses in (
        (machine.RUN_MOVES, RUN_STATUSES),
        (machine.STEP_MOVES, STEP_STATUSES),
        (machine.CALL_MOVES, CALL_STATUSES),
    ):
        assert set(table) == set(statuses)
        for targets in table.values():
            assert targets <= set(statuses)
    for status in Run.TERMINAL:
        assert machine.RUN_MOVES[status] == frozenset(), "an ended run never moves again"
    assert set(machine.RUN_REASONS) <= set(RUN_STATUSES)
    for reasons in machine.RUN_REASONS.values():
        assert reasons <= set(Run.Reason.values) | {""}


def test_every_run_move_at_the_write(system_actor):
    """All 81 pairs: an allowed move is written with its event; a forbidden one raises
    ``ForbiddenMove`` and leaves the row and its record as they were."""
    for before, after in itertools.product(RUN_STATUSES, RUN_STATUSES):
        run = _run(system_actor, before)
        events = RunEvent.objects.filter(run_id=run.id).count()
        reason = _reason_for(after)
        if machine.allowed("run", before, after):
            _move(run, after, reason)
            run.refresh_from_db()
            assert (run.status, run.reason_code) == (after, reason), (before, after)
            assert RunEvent.objects.filter(run_id=run.id).count() == events + 1
        else:
            with pytest.raises(machine.ForbiddenMove), transaction.atomic():
                _move(run, after, reason)
            run.refresh_from_db()
            assert run.status == before, (before, after)
            assert RunEvent.objects.filter(run_id=run.id).count() == events


def test_a_status_carries_only_its_reasons(system_actor):
    run = _run(system_actor, Run.Status.RUNNING)
    with pytest.raises(machine.ForbiddenMove, match="reason"), transaction.atomic():
        _move(run, Run.Status.NEEDS_ATTENTION, Run.Reason.APPROVAL_REJECTED)
    with pytest.raises(machine.ForbiddenMove, match="reason"), transaction.atomic():
        _move(run, Run.Status.NEEDS_ATTENTION, "")  # a park always says why
    with pytest.raises(machine.ForbiddenMove, match="reason"), transaction.atomic():
        _move(run, Run.Status.SUCCEEDED, Run.Reason.AGENT_FAILED)
    for reason in sorted(machine.RUN_REASONS[Run.Status.NEEDS_ATTENTION]):
        run = _run(system_actor, Run.Status.RUNNING)
        _move(run, Run.Status.NEEDS_ATTENTION, reason)
        assert Run.objects.get(id=run.id).reason_code == reason


def test_a_write_that_leaves_the_status_alone_is_not_checked(system_actor):
    run = _run(system_actor, Run.Status.SUCCEEDED)
    with checkpoint(run.id, actor="test", channel="cli") as cp:
        cp.event("run.noted")
        cp.update(reason_detail="an auditor's note")
    assert Run.objects.get(id=run.id).reason_detail == "an auditor's note"


def _call(run: Run, status: str) -> ToolCall:
    step = Step.objects.create(run=run, seq=1, kind=Step.Kind.TOOL_CALL, incarnation=1)
    return ToolCall.objects.create(
        step=step,
        run=run,
        tool_name="refund_payment",
        tool_version="v1",
        effect="reconcilable",
        arguments={},
        arguments_digest="d",
        idempotency_key=f"{run.id}:1",
        status=status,
    )


@pytest.mark.parametrize("status", CALL_STATUSES)
def test_a_receipt_for_a_call_in_each_status(system_actor, status):
    """A receipt moves a call to succeeded: from dispatching, unknown or (a family's
    adopted receipt) proposed — never from a call that was rejected, cancelled or already
    settled the other way, nor one still waiting for its approval."""
    run = _run(system_actor, Run.Status.RUNNING)
    call = _call(run, status)

    def receipt():
        with checkpoint(run.id, actor="test", channel="cli") as cp:
            transitions.record_receipt(
                cp,
                call,
                ok=True,
                result={},
                external_ref="",
                source="operator",
                recorded_by="test",
                incarnation=None,
            )

    if machine.allowed("call", status, ToolCall.Status.SUCCEEDED):
        receipt()
        assert ToolCall.objects.get(id=call.id).status == ToolCall.Status.SUCCEEDED
    else:
        with pytest.raises(machine.ForbiddenMove), transaction.atomic():
            receipt()
        assert ToolCall.objects.get(id=call.id).status == status
        assert not RunEvent.objects.filter(run_id=run.id, type="tool.succeeded").exists()
    expected = {ToolCall.Status.DISPATCHING, ToolCall.Status.UNKNOWN, ToolCall.Status.PROPOSED}
    assert machine.allowed("call", status, ToolCall.Status.SUCCEEDED) == (
        status in expected or status == ToolCall.Status.SUCCEEDED
    )


@pytest.mark.parametrize("status", STEP_STATUSES)
def test_a_step_ends_once(system_actor, status):
    run = _run(system_actor, Run.Status.RUNNING)
    step = Step.objects.create(run=run, seq=1, kind=Step.Kind.WAIT, incarnation=1, status=status)
    agent = registry.agent("refund")

    def fail():
        with checkpoint(run.id, actor="test", channel="cli") as cp:
            transitions.fail_step(cp, run=run, agent=agent, step=step, error="boom")

    if status in (Step.Status.PENDING, Step.Status.FAILED):
        fail()
        assert Step.objects.get(id=step.id).status == Step.Status.FAILED
    else:
        with pytest.raises(machine.ForbiddenMove), transaction.atomic():
            fail()
        assert Step.objects.get(id=step.id).status == status
