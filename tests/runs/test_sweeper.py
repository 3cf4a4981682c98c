"""The sweeper re-enqueues runs whose wake-up may have been lost, and only those: under a
backlog (more runs queued than the workers get through in ``REQUEUE_AFTER``) a run still in
line is not enqueued again, or every sweep would add a duplicate wake-up of every queued run
and the workers would spend their time on duplicates."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django_q.models import OrmQ

from runs import sweeper
from runs.models import Run
from runs.registry import Finish
from runs.services import run_create
from tests.support import ScriptedAgent, expire_lease


@pytest.fixture
def runs(register, system_actor):
    agent = register(ScriptedAgent("sweepee", lambda ctx: Finish({})))

    def make(enqueued_seconds_ago: float | None) -> Run:
        run = run_create(agent_name=agent.name, actor=system_actor)
        enqueued_at = (
            None
            if enqueued_seconds_ago is None
            else timezone.now() - timedelta(seconds=enqueued_seconds_ago)
        )
        Run.objects.filter(id=run.id).update(enqueued_at=enqueued_at)
        return run

    OrmQ.objects.all().delete()  # the wake-ups run_create enqueued: each test sets its own
    return make


def _wakeup(seconds_ago: float) -> OrmQ:
    """A wake-up waiting in the broker since then (``lock`` is when it was enqueued)."""
    return OrmQ.objects.create(
        key="agentops", payload="-", lock=timezone.now() - timedelta(seconds=seconds_ago)
    )


@pytest.mark.django_db
def test_a_run_not_claimed_within_requeue_after_is_enqueued_again(runs):
    lost = runs(enqueued_seconds_ago=60)
    fresh = runs(enqueued_seconds_ago=0)

    assert sweeper.runnable_orphans() == [lost.id]
    assert sweeper.sweep() == 1
    assert OrmQ.objects.count() == 1
    # stamped: the next sweep leaves it alone
    assert sweeper.runnable_orphans() == []
    assert fresh.id not in sweeper.runnable_orphans()


@pytest.mark.django_db
def test_runs_still_in_line_behind_an_older_wakeup_are_not_enqueued_again(runs):
    _wakeup(seconds_ago=120)  # the workers are two minutes behind
    in_line = [runs(enqueued_seconds_ago=60), runs(enqueued_seconds_ago=30)]
    before_the_line = runs(enqueued_seconds_ago=300)
    never_enqueued = runs(enqueued_seconds_ago=None)

    orphans = sweeper.runnable_orphans()

    assert set(orphans) == {before_the_line.id, never_enqueued.id}
    assert not set(orphans) & {run.id for run in in_line}


@pytest.mark.django_db
def test_a_wakeup_a_worker_is_running_does_not_hold_the_line(runs):
    # dequeued by a worker: its lock is in the future (until the broker's retry)
    OrmQ.objects.create(key="agentops", payload="-", lock=timezone.now() + timedelta(seconds=60))
    lost = runs(enqueued_seconds_ago=60)

    assert sweeper.runnable_orphans() == [lost.id]


@pytest.mark.django_db
def test_a_dead_workers_runs_are_enqueued_whatever_the_line(runs):
    _wakeup(seconds_ago=120)
    run = runs(enqueued_seconds_ago=None)
    # claimed by a worker that died: claiming clears enqueued_at, the lease ran out
    Run.objects.filter(id=run.id).update(
        status=Run.Status.RUNNING, lease_owner="dead", fence=1, enqueued_at=None
    )
    expire_lease(run.id)

    assert sweeper.runnable_orphans() == [run.id]


@pytest.mark.django_db
def test_repeated_sweeps_under_a_backlog_add_no_duplicates(runs):
    queued = [runs(enqueued_seconds_ago=0) for _ in range(5)]
    for _ in queued:
        _wakeup(seconds_ago=0)
    # the workers are slow: REQUEUE_AFTER passes many times while the runs wait their turn
    OrmQ.objects.update(lock=timezone.now() - timedelta(seconds=100))
    Run.objects.filter(id__in=[run.id for run in queued]).update(
        enqueued_at=timezone.now() - timedelta(seconds=100)
    )

    for _ in range(3):
        sweeper.sweep()

    assert OrmQ.objects.count() == len(queued)
