"""Claiming a run's lease (DESIGN §3): one compare-and-set in database time, and fencing."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from runs import engine
from runs.actors import Actor
from runs.models import Run, RunEvent, Step
from runs.record.checkpoint import LeaseLost
from runs.registry import CallTool, Effect, Finish
from runs.services import run_create, run_pause, run_terminate
from tests.support import (
    CountingTool,
    ScriptedAgent,
    close_connection,
    events,
    expire_lease,
    make_tool,
)


@pytest.fixture
def agent(register):
    """Reads once, then finishes."""
    body = CountingTool()

    def decide(ctx):
        if not ctx.steps:
            return CallTool("claim_read", {})
        return Finish({"done": True})

    register(make_tool("claim_read", body), ScriptedAgent("claimer", decide, tools=("claim_read",)))
    return body


def _new_run(system_actor) -> Run:
    return run_create(agent_name="claimer", actor=system_actor)


@pytest.mark.django_db(transaction=True)
def test_racing_claimers_exactly_one_wins_and_fence_moves_once(agent, system_actor):
    for _ in range(5):
        run = _new_run(system_actor)
        barrier = threading.Barrier(2)
        results: dict[str, object] = {}
        errors: list[BaseException] = []

        def claimer(
            name: str, run_id=run.id, barrier=barrier, results=results, errors=errors
        ) -> None:
            try:
                barrier.wait(timeout=5)
                results[name] = engine.claim(run_id, worker=name)
            except BaseException as exc:
                errors.append(exc)
            finally:
                close_connection()

        threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)

        winners = [name for name, lease in results.items() if lease is not None]
        assert errors == []
        assert len(results) == 2
        assert len(winners) == 1
        run.refresh_from_db()
        assert run.fence == 1
        assert run.lease_owner == winners[0]
        assert run.status == Run.Status.RUNNING
        claimed = events(run.id, "run.claimed")
        assert [(e.payload["worker"], e.payload["fence"]) for e in claimed] == [(winners[0], 1)]


@pytest.mark.django_db
def test_live_lease_cannot_be_claimed(agent, system_actor):
    run = _new_run(system_actor)
    assert engine.claim(run.id, worker="w1") is not None

    assert engine.claim(run.id, worker="w2") is None

    run.refresh_from_db()
    assert (run.fence, run.lease_owner, run.recovery_count) == (1, "w1", 0)
    assert len(events(run.id, "run.claimed")) == 1


@pytest.mark.django_db
def test_expired_lease_is_claimed_as_a_recovery(agent, system_actor):
    run = _new_run(system_actor)
    first = engine.claim(run.id, worker="w1")
    assert first.recovered is False
    expire_lease(run.id)

    second = engine.claim(run.id, worker="w2")

    assert second is not None
    assert second.recovered is True
    run.refresh_from_db()
    assert (run.fence, run.lease_owner, run.recovery_count) == (2, "w2", 1)
    assert run.lease_expires_at > timezone.now()
    claimed = events(run.id, "run.claimed")
    assert [e.payload["recovered"] for e in claimed] == [False, True]
    assert claimed[-1].payload["recovery_count"] == 1
    assert claimed[-1].incarnation == 2


@pytest.mark.django_db
@pytest.mark.parametrize(
    "status",
    [
        Run.Status.SUCCEEDED,
        Run.Status.FAILED,
        Run.Status.TERMINATED,
        Run.Status.WAITING_APPROVAL,
        Run.Status.NEEDS_ATTENTION,
        Run.Status.PAUSED,
    ],
)
def test_run_that_is_not_runnable_is_not_claimed(agent, system_actor, status):
    run = _new_run(system_actor)
    Run.objects.filter(id=run.id).update(status=status)

    assert engine.claim(run.id, worker="w1") is None

    run.refresh_from_db()
    assert (run.status, run.fence, run.lease_owner) == (status, 0, "")
    assert events(run.id, "run.claimed") == []


@pytest.mark.django_db
def test_future_wake_at_blocks_the_claim_until_it_is_due(agent, system_actor):
    run = _new_run(system_actor)
    Run.objects.filter(id=run.id).update(wake_at=timezone.now() + timedelta(minutes=5))

    assert engine.claim(run.id, worker="w1") is None

    Run.objects.filter(id=run.id).update(wake_at=timezone.now() - timedelta(seconds=1))
    lease = engine.claim(run.id, worker="w1")
    assert lease is not None
    run.refresh_from_db()
    assert run.wake_at is None


@pytest.mark.django_db
def test_unknown_run_is_not_claimed():
    import uuid

    assert engine.claim(uuid.uuid4(), worker="w1") is None


# --- fencing: a zombie incarnation writes nothing ---------------------------------------------


@pytest.mark.django_db
def test_zombie_checkpoint_raises_lease_lost_and_writes_nothing(agent, system_actor):
    run = _new_run(system_actor)
    zombie = engine.claim(run.id, worker="w1")
    expire_lease(run.id)  # w1 was paused past its lease ...
    assert engine.claim(run.id, worker="w2") is not None  # ... and w2 took over
    events_before = RunEvent.objects.filter(run=run).count()

    # the savepoint keeps this test's own transaction usable after the rollback
    with pytest.raises(LeaseLost), transaction.atomic(), zombie.checkpoint() as cp:
        Step.objects.create(run_id=run.id, seq=1, kind=Step.Kind.WAIT, incarnation=1)
        cp.event("step.decided", seq=1)
        cp.update(steps_used=5)

    run.refresh_from_db()
    assert RunEvent.objects.filter(run=run).count() == events_before
    assert not RunEvent.objects.filter(run=run, incarnation=1).exclude(type="run.claimed").exists()
    assert not Step.objects.filter(run=run).exists()
    assert (run.fence, run.lease_owner, run.steps_used) == (2, "w2", 0)


@pytest.mark.parametrize("action", ["terminate", "pause"])
@pytest.mark.django_db
def test_a_holder_past_its_lease_writes_nothing_after_an_operator_ended_the_run(
    agent, system_actor, operator, action
):
    """Nobody claimed the run after w1's lease expired, so w1 still has the latest fence;
    an operator's terminate (or pause) applies at once. w1, only paused, wakes up: its
    writes — the hot path's and the locked ones — are refused, and the run stays as ended."""
    run = _new_run(system_actor)
    holder = engine.claim(run.id, worker="w1")
    expire_lease(run.id)
    act = run_terminate if action == "terminate" else run_pause
    ended = act(run_id=run.id, actor=Actor.for_user(operator, "web"), reason="stop it")
    assert ended.status in (Run.Status.TERMINATED, Run.Status.PAUSED)

    for reads in (False, True):  # a body that only collects; one that locks at a read
        with (
            pytest.raises(LeaseLost),
            transaction.atomic(),
            holder.checkpoint() as cp,
        ):
            cp.event("run.note", text="from the past")
            if reads:
                assert cp.run.status
            cp.update(steps_used=7)
    with pytest.raises(LeaseLost), transaction.atomic():
        engine.advance_once(holder)

    run.refresh_from_db()
    assert (run.status, run.steps_used) == (ended.status, 0)
    # (a free read may be made before its commit is refused: it has no side effect)
    assert not Step.objects.filter(run=run, kind=Step.Kind.TOOL_CALL).exists()
    assert not RunEvent.objects.filter(run=run, type="run.note").exists()


@pytest.mark.django_db
def test_zombie_cannot_advance_a_run_another_worker_claimed(register, system_actor):
    body = CountingTool()
    register(
        make_tool("claim_write", body, effect=Effect.IDEMPOTENT),
        ScriptedAgent(
            "claim_writer",
            lambda ctx: Finish({}) if ctx.steps else CallTool("claim_write", {}),
            tools=("claim_write",),
        ),
    )
    run = run_create(agent_name="claim_writer", actor=system_actor)
    zombie = engine.claim(run.id, worker="w1")
    expire_lease(run.id)
    engine.claim(run.id, worker="w2")

    with pytest.raises(LeaseLost), transaction.atomic():
        engine.advance_once(zombie)

    assert body.calls == []  # the zombie's decision never reached the tool
    assert not Step.objects.filter(run=run).exists()


@pytest.mark.django_db
def test_a_zombies_free_read_records_nothing(agent, system_actor):
    """A read decided at no cost is called before its one commit (docs/recovery.md): a
    zombie may make the read, which has no side effect, and its commit is refused."""
    run = _new_run(system_actor)
    zombie = engine.claim(run.id, worker="w1")
    expire_lease(run.id)
    engine.claim(run.id, worker="w2")

    with pytest.raises(LeaseLost), transaction.atomic():
        engine.advance_once(zombie)

    assert not Step.objects.filter(run=run).exists()
    assert not RunEvent.objects.filter(run=run, incarnation=1).exclude(type="run.claimed").exists()
