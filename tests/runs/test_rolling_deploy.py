"""Rolling deploys (docs/operations.md, "Deploying"): old and new workers side by side. A
worker that cannot serve a run (its agent version, a call's tool fingerprint) hands it to a
live worker that can, instead of parking it for a person; with none, the old rules hold."""

from __future__ import annotations

import time

import pytest
from django.db import transaction
from django.db.models.functions import Now

from runs.models import Run, Worker
from runs.registry import registry
from runs.services import run_create
from tests.conftest import drive
from tests.rolling.agents import build
from tests.runs.workerprocs import wait_for, worker_env
from tests.support import events


@pytest.fixture
def release_1(register):
    tool, agent = build("1")
    register(tool, agent)
    return tool, agent


def _started_on_release_2(system_actor) -> Run:
    """A run created by the new release's web process: its agent version is 2. One
    transaction, so no worker sees (and claims) it before it is version 2 — the wake-up is
    enqueued at the commit."""
    with transaction.atomic():
        run = run_create(agent_name="rolling", actor=system_actor)
        Run.objects.filter(id=run.id).update(agent_version="2")
    return run


def _worker_serving(name: str, release: str) -> Worker:
    tool, agent = build(release)
    serves = {
        "agents": {"rolling": sorted({agent.version} | {s for s, _t, _f in agent.migrations})},
        "tools": {"rolling_read": sorted({tool.version, *tool.compatible_with})},
    }
    return Worker.objects.create(
        name=name,
        host="h2",
        pid=1,
        started_at=Now(),
        heartbeat_at=Now(),
        health=Worker.Health.HEALTHY,
        serves=serves,
    )


@pytest.mark.django_db
def test_an_old_worker_hands_a_new_release_run_to_a_worker_that_serves_it(release_1, system_actor):
    _worker_serving("new-1", "2")
    run = _started_on_release_2(system_actor)

    run = drive(run.id, max_slices=1)

    assert run.status == Run.Status.QUEUED  # not parked: waiting for new-1
    assert run.wake_at is not None and run.enqueued_at is None
    [handed] = events(run.id, "run.handed_off")
    assert handed.payload["to"] == ["new-1"]
    assert "rolling version 2: this worker runs 1" in handed.payload["reason"]
    assert not events(run.id, "step.decided")


@pytest.mark.django_db
def test_with_no_worker_serving_it_the_run_waits_for_a_person_as_before(release_1, system_actor):
    stale = _worker_serving("gone-1", "2")
    Worker.objects.filter(name=stale.name).update(health=Worker.Health.STOPPED)
    run = _started_on_release_2(system_actor)

    run = drive(run.id)

    assert (run.status, run.reason_code) == (
        Run.Status.NEEDS_ATTENTION,
        "incompatible_agent_version",
    )
    assert not events(run.id, "run.handed_off")


def test_the_registry_says_what_a_worker_serves(release_1):
    serves = registry.serves()
    assert serves["agents"]["rolling"] == ["1"]
    assert serves["tools"]["rolling_read"] == [release_1[0].version]
    tool_2, agent_2 = build("2")
    assert agent_2.migration_path("1") is not None
    assert release_1[0].version in tool_2.compatible_with


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_old_and_new_workers_side_by_side_strand_no_run(worker_procs, system_actor, register):
    new = worker_procs.start(
        "new-1", worker_env(AGENTOPS_APPS="tests.rolling", ROLLING_VERSION="2")
    )
    new.wait_running()
    old = worker_procs.start(
        "old-1", worker_env(AGENTOPS_APPS="tests.rolling", ROLLING_VERSION="1")
    )
    old.wait_running()
    tool, agent = build("1")
    register(tool, agent)  # so that run_create here knows the agent
    runs = [run_create(agent_name="rolling", actor=system_actor) for _ in range(6)]
    runs += [_started_on_release_2(system_actor) for _ in range(6)]
    ids = [run.id for run in runs]

    def settled():
        return (
            not Run.objects.filter(id__in=ids)
            .exclude(status__in=Run.TERMINAL)
            .exclude(status=Run.Status.NEEDS_ATTENTION)
            .exists()
        )

    wait_for(settled, 90, what=f"12 runs to end:\n{old.output()[-3000:]}\n{new.output()[-3000:]}")
    time.sleep(0.2)

    finished = {run.id: run for run in Run.objects.filter(id__in=ids)}
    stranded = [r for r in finished.values() if r.status != Run.Status.SUCCEEDED]
    assert not stranded, [(r.status, r.reason_code, r.reason_detail) for r in stranded]
    for run in runs[6:]:
        # a run of the new release is only ever driven by the new release's code
        assert finished[run.id].result["served_by"] == ["2", "2", "2"]
        assert finished[run.id].result["decided_by"] == "2"
    for run in runs[:6]:
        result = finished[run.id].result
        # an old run finishes on the old release, or is migrated by the new one
        assert result["decided_by"] == "1" or result["migrated"], result
