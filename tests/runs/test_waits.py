"""Durable waits: a waiting run holds no worker, timers and timeouts live in the database and
are woken by the sweeper (also when they fell due while no worker ran), a timed-out wait
resumes the agent with its default, and the run never shows waiting after its wait ended."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from runs import engine, sweeper
from runs.models import Run, Step
from runs.registry import Sleep, WaitForSignal
from runs.services import run_create, run_terminate
from tests.conftest import drive
from tests.runs.wait_support import assert_no_lease, fall_due, waits_then_finishes
from tests.support import event_types, events


def _start(register, system_actor, *waits) -> Run:
    agent = register(waits_then_finishes("waiter", *waits))
    return run_create(agent_name=agent.name, actor=system_actor)


@pytest.mark.django_db
def test_a_signal_wait_parks_the_run_with_no_lease_and_its_timeout_as_wake_at(
    register, system_actor
):
    run = _start(register, system_actor, WaitForSignal("go", timeout_seconds=600))
    before = timezone.now()

    run = drive(run.id)

    assert_no_lease(run)
    assert before + timedelta(seconds=590) < run.wake_at < before + timedelta(seconds=610)
    step = Step.objects.get(run=run)
    assert (step.kind, step.status) == (Step.Kind.WAIT, Step.Status.PENDING)
    assert step.input["wait"] == "signal" and step.input["name"] == "go"
    waiting = events(run.id, "run.waiting")
    assert [(e.payload["on"], e.payload["name"], e.payload["seq"]) for e in waiting] == [
        ("signal", "go", 1)
    ]
    # a wake-up before the timeout finds nothing to claim and writes nothing
    count = len(event_types(run.id))
    assert engine.advance(run.id, worker="w2") == "not_claimed"
    assert len(event_types(run.id)) == count
    assert run.id not in sweeper.runnable_orphans()


@pytest.mark.django_db
def test_a_wait_with_no_timeout_is_never_woken_by_the_sweeper(register, system_actor):
    run = _start(register, system_actor, WaitForSignal("go"))
    run = drive(run.id)

    assert_no_lease(run)
    assert run.wake_at is None
    assert run.id not in sweeper.runnable_orphans()
    assert engine.claim(run.id, worker="w2") is None


@pytest.mark.django_db
def test_a_timer_that_fell_due_while_no_worker_ran_is_woken_by_the_sweeper(register, system_actor):
    run = _start(register, system_actor, Sleep(seconds=3600))
    run = drive(run.id)
    assert_no_lease(run)

    fall_due(run.id)  # the hour passed while every worker was down
    assert sweeper.sweep() >= 1  # what a booting worker's sweeper does first
    run.refresh_from_db()
    assert run.enqueued_at is not None
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    step = Step.objects.get(run=run, seq=1)
    assert step.status == Step.Status.COMPLETED
    assert step.output == {"until": step.input["until"]}
    [ended] = events(run.id, "run.wait_ended")
    assert (ended.payload["ended_by"], ended.payload["timed_out"]) == ("timer", False)
    claims = events(run.id, "run.claimed")
    assert [c.payload["recovered"] for c in claims] == [False, False]


@pytest.mark.django_db
def test_a_timed_out_signal_wait_resumes_the_agent_with_its_default(register, system_actor):
    run = _start(
        register,
        system_actor,
        WaitForSignal("go", timeout_seconds=60, default={"go": False}),
        WaitForSignal("again", timeout_seconds=60),
    )
    run = drive(run.id)
    fall_due(run.id)

    run = drive(run.id)

    # the first wait ended with its default; the run is waiting on the second one, not the first
    assert_no_lease(run)
    first = Step.objects.get(run=run, seq=1)
    assert (first.status, first.output) == (Step.Status.COMPLETED, {"go": False})
    [timed_out] = events(run.id, "run.wait_timed_out")
    assert timed_out.payload == {
        "seq": 1,
        "on": "signal",
        "name": "go",
        "default": {"go": False},
        "timed_out": True,
    }
    types = event_types(run.id)
    assert types.index("run.wait_timed_out") < types.index("step.decided", 4)
    assert events(run.id, "run.waiting")[-1].payload["name"] == "again"

    fall_due(run.id)
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert run.result["outputs"] == [{"go": False}, None]


@pytest.mark.django_db
def test_a_timer_already_due_when_decided_does_not_park(register, system_actor):
    run = _start(register, system_actor, Sleep(until=timezone.now() - timedelta(seconds=5)))

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert "run.waiting" not in event_types(run.id)
    assert len(events(run.id, "run.claimed")) == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    "wait, error",
    [
        (Sleep(), "exactly one of until and seconds"),
        (Sleep(until=timezone.now().replace(tzinfo=None)), "timezone-aware"),
        (WaitForSignal(""), "needs a name"),
        (WaitForSignal("go", default=object()), "not JSON"),
    ],
)
def test_an_invalid_wait_is_a_failed_step_the_agent_sees(register, system_actor, wait, error):
    run = _start(register, system_actor, wait)

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    step = Step.objects.get(run=run, seq=1)
    assert (step.kind, step.status) == (Step.Kind.WAIT, Step.Status.FAILED)
    assert error in step.error
    assert error in run.result["errors"][0]


@pytest.mark.django_db
def test_the_agent_is_not_asked_again_for_a_wait_it_decided(register, system_actor):
    calls: list[int] = []
    agent = waits_then_finishes("waiter", WaitForSignal("go", timeout_seconds=60))
    decide = agent._decide

    def counting(ctx):
        calls.append(len(ctx.steps))
        return decide(ctx)

    agent._decide = counting
    register(agent)
    run = run_create(agent_name="waiter", actor=system_actor)
    drive(run.id)
    fall_due(run.id)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert calls == [0, 1]  # decided the wait once; asked only for what came after it


@pytest.mark.django_db
def test_terminating_a_waiting_run_ends_its_wait(register, system_actor):
    run = _start(register, system_actor, WaitForSignal("go", timeout_seconds=60))
    drive(run.id)

    run = run_terminate(run_id=run.id, actor=system_actor, reason="customer left")

    assert run.status == Run.Status.TERMINATED
    assert run.wake_at is None
    assert Step.objects.get(run=run).status == Step.Status.FAILED
    assert engine.claim(run.id, worker="w2") is None
