"""``runworker``: an exclusive identity, takeover of a dead predecessor's leases at once,
clear one-line errors for bad configuration, a clean stop on SIGTERM, and the liveness check
that notices a frozen cluster."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from agentops.demo.sandbox import free_port
from runs.dbtime import db_now
from runs.models import Run, RunEvent, ToolCall, Worker
from runs.services import run_create
from runs.workers import check_liveness
from tests.runs.workerprocs import MANAGE, one_line, wait_for, worker_env
from tests.support import event_types, refunds, set_faults

slow = pytest.mark.slow


def _manage(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, MANAGE, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def _refund_run(system_actor, amount: int = 500) -> Run:
    return run_create(
        agent_name="refund",
        input={"order_id": "ord_1002", "amount_cents": amount},
        actor=system_actor,
    )


@slow
@pytest.mark.django_db(transaction=True)
def test_a_second_worker_with_the_same_name_is_refused_while_the_first_lives(worker_procs):
    env = worker_env()
    first = worker_procs.start("dup-1", env)
    first.wait_running()

    second = _manage(env, "runworker", "--name", "dup-1")

    assert second.returncode != 0
    line = one_line(second.stderr + second.stdout)
    assert "dup-1" in line and "held by pid" in line and str(first.pid) in line
    assert first.alive
    assert Worker.objects.get(name="dup-1").pid == first.pid


@slow
@pytest.mark.django_db(transaction=True)
def test_a_restarted_worker_takes_over_its_dead_predecessors_leases_at_once(
    worker_procs, sandbox, system_actor
):
    # leases far longer than the test: only the takeover can explain a quick recovery
    env = worker_env(sandbox, AGENTOPS_LEASE_TTL="120")
    set_faults(sandbox, latency_ms=1500)  # the refund is in flight when the worker dies
    run = _refund_run(system_actor)
    worker = worker_procs.start("phoenix", env)
    wait_for(
        lambda: ToolCall.objects.filter(
            run=run, tool_name="refund_payment", status=ToolCall.Status.DISPATCHING
        ).exists(),
        20,
        what="the refund to be dispatched",
    )
    worker.kill_group()
    killed_at = time.monotonic()
    held = Run.objects.get(id=run.id)
    assert held.status == Run.Status.RUNNING and held.lease_owner == "phoenix"
    assert held.lease_expires_at > db_now() + timedelta(seconds=60)

    worker_procs.start("phoenix", env)
    recovered = wait_for(
        lambda: RunEvent.objects.filter(
            run=run, type="run.claimed", payload__recovered=True
        ).first(),
        20,
        what="a recovered claim",
    )
    assert time.monotonic() - killed_at < 20  # the lease had almost two minutes left
    assert recovered.payload["worker"] == "phoenix"
    wait_for(lambda: Run.objects.get(id=run.id).status in Run.TERMINAL, 30, what="the run to end")
    assert Run.objects.get(id=run.id).status == Run.Status.SUCCEEDED
    assert [r["idempotency_key"] for r in refunds(sandbox)] == [f"{run.id}:2"]


@pytest.mark.parametrize("value", ["nowhere", "claimed:0", "claimed:x", "dispatching:-1"])
def test_a_malformed_crash_spec_is_a_one_line_error(value):
    result = _manage(worker_env(AGENTOPS_CRASH_AT=value), "runworker", "--name", "bad-spec")

    assert result.returncode != 0
    line = one_line(result.stderr + result.stdout)
    assert line.startswith("CommandError: AGENTOPS_CRASH_AT=")


def test_an_unreachable_database_is_a_one_line_error():
    url = f"postgres://postgres@127.0.0.1:{free_port()}/nowhere"
    result = _manage(worker_env(DATABASE_URL=url), "runworker", "--name", "no-db")

    assert result.returncode != 0
    line = one_line(result.stderr + result.stdout)
    assert line.startswith("CommandError: cannot reach the database")


def test_an_unmigrated_database_is_a_one_line_error(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.sqlite3'}"
    result = _manage(worker_env(DATABASE_URL=url), "runworker", "--name", "no-tables")

    assert result.returncode != 0
    assert "not migrated" in one_line(result.stderr + result.stdout)


@slow
@pytest.mark.django_db(transaction=True)
def test_sigterm_stops_the_worker_cleanly_within_ten_seconds(worker_procs, sandbox, system_actor):
    # long slices, and a refund in flight when the signal arrives
    env = worker_env(sandbox, AGENTOPS_SLICE_SECONDS="600")
    set_faults(sandbox, latency_ms=1500)
    run = _refund_run(system_actor)
    worker = worker_procs.start("graceful", env)
    worker.wait_running()
    wait_for(
        lambda: ToolCall.objects.filter(
            run=run, tool_name="refund_payment", status=ToolCall.Status.DISPATCHING
        ).exists(),
        20,
        what="the refund to be dispatched",
    )

    worker.process.send_signal(signal.SIGTERM)  # the main process only
    started = time.monotonic()
    returncode = worker.wait_exit(10)

    assert time.monotonic() - started < 10
    assert returncode == 0, worker.output()
    # no headless cluster processes left behind
    wait_for(lambda: not worker.group_alive(), 2, what="the process group to be gone")
    assert worker.output().rstrip().endswith("worker graceful stopped")
    assert Worker.objects.get(name="graceful").health == Worker.Health.STOPPED
    # the call in flight was recorded, then the slice yielded at that step boundary: the
    # run is handed back for another worker, not abandoned with a live lease
    call = ToolCall.objects.get(run=run, tool_name="refund_payment")
    assert call.status == ToolCall.Status.SUCCEEDED
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED and run.lease_expires_at is None
    assert event_types(run.id)[-2:] == ["tool.succeeded", "run.released"]


@pytest.mark.django_db
def test_the_liveness_check_marks_a_cluster_that_runs_nothing_while_tasks_wait_frozen():
    long_ago = db_now() - timedelta(minutes=5)
    worker = Worker.objects.create(
        name="stuck",
        host="here",
        pid=1,
        started_at=long_ago,
        heartbeat_at=db_now(),
        last_task_at=long_ago,
        health=Worker.Health.HEALTHY,
    )

    health = check_liveness("stuck", worker.boot_id, pending_tasks=3, started=0.0, now=600.0)

    worker.refresh_from_db()
    assert health == Worker.Health.FROZEN == worker.health
    assert "frozen" in worker.detail and "3 wait" in worker.detail


@pytest.mark.django_db
def test_the_liveness_check_does_not_call_an_idle_or_busy_cluster_frozen():
    long_ago = db_now() - timedelta(minutes=5)
    worker = Worker.objects.create(
        name="idle",
        host="here",
        pid=1,
        started_at=long_ago,
        heartbeat_at=db_now(),
        last_task_at=long_ago,
        health=Worker.Health.FROZEN,
    )

    # nothing waits: idle, not frozen
    assert check_liveness("idle", worker.boot_id, pending_tasks=0, started=0.0, now=600.0) == (
        Worker.Health.HEALTHY
    )
    # tasks wait, but one ran a moment ago
    Worker.objects.filter(name="idle").update(last_task_at=db_now(), health=Worker.Health.FROZEN)
    assert check_liveness("idle", worker.boot_id, pending_tasks=5, started=0.0, now=600.0) == (
        Worker.Health.HEALTHY
    )
    worker.refresh_from_db()
    assert worker.health == Worker.Health.HEALTHY and worker.detail == ""
