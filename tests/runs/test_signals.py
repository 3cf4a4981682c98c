"""Signals: kept when they arrive before the wait, wake a waiting run, delivered once per
idempotency key, consumed exactly once across crashes, refused by a finished run."""

from __future__ import annotations

import pytest

from runs import engine
from runs.actors import Actor, PermissionDenied
from runs.models import Run, Signal, Step
from runs.record import transitions
from runs.record.checkpoint import _crash_points_now
from runs.registry import CallTool, Finish, WaitForSignal
from runs.services import InvalidState, run_create
from runs.waits import SignalKeyReused, run_signal
from tests.conftest import drive
from tests.runs.wait_support import assert_no_lease, fall_due, waits_then_finishes
from tests.support import (
    CountingTool,
    ScriptedAgent,
    WorkerKilled,
    event_types,
    events,
    expire_lease,
    make_tool,
)


def _start(register, system_actor, *waits) -> Run:
    agent = register(waits_then_finishes("waiter", *waits))
    return run_create(agent_name=agent.name, actor=system_actor)


def _signal(run, system_actor, name="go", payload=None, **kwargs) -> Signal:
    return run_signal(
        run_id=run.id, name=name, payload=payload or {"ok": True}, actor=system_actor, **kwargs
    )


@pytest.mark.django_db
def test_a_signal_sent_before_the_wait_began_is_delivered_when_it_begins(register, system_actor):
    run = _start(register, system_actor, WaitForSignal("go", timeout_seconds=60))
    signal = _signal(run, system_actor, payload={"approved_by": "finance"})
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED  # kept; the run was not waiting yet
    assert events(run.id, "run.signalled")[0].payload["delivered"] == "kept"

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result["outputs"] == [{"approved_by": "finance"}]
    assert "run.waiting" not in event_types(run.id)  # the wait ended in its own commit
    signal.refresh_from_db()
    assert signal.consumed_at is not None
    assert signal.consumed_by_step == Step.objects.get(run=run, seq=1)


@pytest.mark.django_db
def test_a_signal_that_arrives_while_the_worker_decides_the_wait_is_not_lost(
    register, system_actor
):
    """The race Inngest lost approvals to: the signal lands between the agent choosing to
    wait and the wait being recorded. The wait's commit looks for it under the run lock."""
    runs: list[Run] = []

    def decide(ctx):
        if not ctx.steps:
            _signal(runs[0], system_actor, payload={"early": True})
            return WaitForSignal("go", timeout_seconds=60)
        return Finish(ctx.steps[0].output)

    register(ScriptedAgent("racer", decide))
    runs.append(run_create(agent_name="racer", actor=system_actor))

    run = drive(runs[0].id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result == {"early": True}


@pytest.mark.django_db
def test_a_signal_to_a_waiting_run_makes_it_runnable_at_once(
    register, system_actor, django_capture_on_commit_callbacks
):
    run = _start(register, system_actor, WaitForSignal("go", timeout_seconds=600))
    run = drive(run.id)
    assert_no_lease(run)

    with django_capture_on_commit_callbacks() as callbacks:
        signal = _signal(run, system_actor, payload={"n": 1}, idempotency_key="evt-1")

    run.refresh_from_db()
    # it never shows waiting once its wait can end, and a wake-up is enqueued on commit
    assert (run.status, run.wake_at) == (Run.Status.QUEUED, None)
    assert run.enqueued_at is not None
    # the wake-up; the other callback fires the commit's fault points (runs.record.checkpoint)
    assert len([c for c in callbacks if getattr(c, "func", None) is not _crash_points_now]) == 1
    [signalled] = events(run.id, "run.signalled")
    assert signalled.payload["delivered"] == "waking"
    assert signalled.payload["signal_id"] == signal.id
    assert signalled.payload["idempotency_key"] == "evt-1"
    assert signalled.actor == "system" and signalled.channel == "cli"

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result["outputs"] == [{"n": 1}]
    [ended] = events(run.id, "run.wait_ended")
    assert (ended.payload["ended_by"], ended.payload["signal_id"]) == ("signal", signal.id)


@pytest.mark.django_db
def test_a_duplicate_signal_is_delivered_once(register, system_actor):
    run = _start(
        register,
        system_actor,
        WaitForSignal("go", timeout_seconds=60),
        WaitForSignal("go", timeout_seconds=60, default="none"),
    )
    drive(run.id)

    first = _signal(run, system_actor, payload={"n": 1}, idempotency_key="evt-1")
    again = _signal(run, system_actor, payload={"n": 1}, idempotency_key="evt-1")
    run = drive(run.id)

    assert again.id == first.id
    assert Signal.objects.filter(run=run).count() == 1
    assert len(events(run.id, "run.signalled")) == 1
    # the second wait does not get the duplicate: it waits, and times out to its default
    assert_no_lease(run)
    assert events(run.id, "run.waiting")[-1].payload["seq"] == 2
    with pytest.raises(SignalKeyReused):
        _signal(run, system_actor, payload={"n": 2}, idempotency_key="evt-1")
    fall_due(run.id)
    run = drive(run.id)
    assert run.result["outputs"] == [{"n": 1}, "none"]


@pytest.mark.django_db
def test_a_signal_with_another_name_is_kept_for_a_later_wait(register, system_actor):
    run = _start(
        register,
        system_actor,
        WaitForSignal("first", timeout_seconds=60),
        WaitForSignal("second", timeout_seconds=60),
    )
    run = drive(run.id)

    _signal(run, system_actor, name="second", payload={"n": 2})
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_EVENT  # not what it waits for: no wake-up
    _signal(run, system_actor, name="first", payload={"n": 1})
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result["outputs"] == [{"n": 1}, {"n": 2}]


@pytest.mark.django_db
def test_signals_of_one_name_are_consumed_in_the_order_they_arrived(register, system_actor):
    run = _start(
        register,
        system_actor,
        WaitForSignal("go", timeout_seconds=60),
        WaitForSignal("go", timeout_seconds=60),
    )
    _signal(run, system_actor, payload={"n": 1})
    _signal(run, system_actor, payload={"n": 2})

    run = drive(run.id)

    assert run.result["outputs"] == [{"n": 1}, {"n": 2}]


@pytest.mark.django_db(transaction=True)
def test_a_crash_between_delivery_and_consumption_consumes_the_signal_once(
    register, system_actor, monkeypatch
):
    tool = CountingTool()
    register(make_tool("after_signal", tool))

    def decide(ctx):
        if not ctx.steps:
            return WaitForSignal("go", timeout_seconds=600)
        if len(ctx.steps) == 1:
            return CallTool("after_signal", {"payload": ctx.steps[0].output})
        return Finish(ctx.steps[0].output)

    register(ScriptedAgent("crashy", decide, tools=("after_signal",)))
    run = run_create(agent_name="crashy", actor=system_actor)
    drive(run.id)
    signal = _signal(run, system_actor, payload={"n": 1})

    # the worker woken by the signal dies inside the commit that consumes it
    real_complete = transitions.complete_step

    def die(*args, **kwargs):
        raise WorkerKilled

    monkeypatch.setattr(transitions, "complete_step", die)
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")
    monkeypatch.setattr(transitions, "complete_step", real_complete)

    signal.refresh_from_db()
    assert signal.consumed_at is None  # rolled back with the step's completion
    assert Step.objects.get(run=run, seq=1).status == Step.Status.PENDING
    run.refresh_from_db()
    assert (run.status, run.lease_owner) == (Run.Status.RUNNING, "w1")

    expire_lease(run.id)
    run = drive(run.id, worker="w2")

    assert run.status == Run.Status.SUCCEEDED
    assert run.result == {"n": 1}
    assert [c["arguments"] for c in tool.calls] == [{"payload": {"n": 1}}]
    signal.refresh_from_db()
    assert signal.consumed_by_step == Step.objects.get(run=run, seq=1)
    assert len(events(run.id, "run.wait_ended")) == 1
    assert events(run.id, "run.claimed")[-1].payload["recovered"] is True


@pytest.mark.django_db(transaction=True)
def test_a_worker_that_dies_after_the_wake_up_claim_leaves_the_signal_for_the_next(
    register, system_actor
):
    run = _start(register, system_actor, WaitForSignal("go", timeout_seconds=600))
    drive(run.id)
    signal = _signal(run, system_actor, payload={"n": 1})
    assert engine.claim(run.id, worker="w1") is not None  # ... and w1 dies here

    expire_lease(run.id)
    run = drive(run.id, worker="w2")

    assert run.status == Run.Status.SUCCEEDED
    assert run.result["outputs"] == [{"n": 1}]
    signal.refresh_from_db()
    assert signal.consumed_at is not None
    assert Signal.objects.filter(run=run, consumed_at__isnull=False).count() == 1


@pytest.mark.django_db
def test_a_signal_to_a_finished_run_is_refused(register, system_actor):
    run = _start(register, system_actor)
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED

    with pytest.raises(InvalidState):
        _signal(run, system_actor)
    assert not Signal.objects.filter(run=run).exists()


@pytest.mark.django_db
def test_people_need_operate_permission_to_signal(register, system_actor, viewer, operator):
    run = _start(register, system_actor, WaitForSignal("go"))
    drive(run.id)

    with pytest.raises(PermissionDenied):
        run_signal(run_id=run.id, name="go", actor=Actor.for_user(viewer, "web"))
    signal = run_signal(run_id=run.id, name="go", actor=Actor.for_user(operator, "web"))

    assert signal.sent_by == "user:olivia"
    assert events(run.id, "run.signalled")[0].actor == "user:olivia"
