"""``runworker``: an exclusive identity, takeover of a dead predecessor's leases at once,
clear one-line errors for bad configuration, a clean stop on SIGTERM, a worker that outlives
its database connections, and the liveness check that notices a frozen cluster."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import suppress
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import OperationalError, connection
from django_q.models import OrmQ

from agentops.demo.sandbox import free_port
from runs import sweeper, workers
from runs.dbtime import db_now
from runs.management.commands import runworker
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


@pytest.mark.django_db
def test_taking_over_wakes_the_dead_predecessors_runs_and_only_those(
    system_actor, django_capture_on_commit_callbacks
):
    # woken before the cluster starts, so its first poll finds them (cold start)
    held, other = _refund_run(system_actor), _refund_run(system_actor)
    OrmQ.objects.all().delete()  # the wake-ups run_create enqueued
    later = db_now() + timedelta(seconds=60)
    for run, owner in ((held, "dead-1"), (other, "alive-1")):
        Run.objects.filter(id=run.id).update(
            status=Run.Status.RUNNING, lease_owner=owner, lease_expires_at=later
        )

    with django_capture_on_commit_callbacks(execute=True):
        assert workers.take_over_predecessor("dead-1") == 1

    held.refresh_from_db()
    other.refresh_from_db()
    assert held.lease_expires_at is None and held.enqueued_at is not None
    assert other.lease_expires_at == later
    assert [wakeup.task["args"] for wakeup in OrmQ.objects.all()] == [(str(held.id),)]
    # stamped as the sweeper stamps a wake-up: the first sweep does not wake it again
    assert held.id not in sweeper.runnable_orphans()


@pytest.mark.parametrize("value", ["nowhere", "claimed:0", "claimed:x", "dispatching:-1"])
def test_a_malformed_crash_spec_is_a_one_line_error(value):
    result = _manage(worker_env(AGENTOPS_CRASH_AT=value), "runworker", "--name", "bad-spec")

    assert result.returncode != 0
    line = one_line(result.stderr + result.stdout)
    assert line.startswith("CommandError: AGENTOPS_CRASH_AT=")


@pytest.mark.parametrize("value", ["nowhere", "before_send:0", "dispatching:x", "claimed:-1"])
def test_a_malformed_pause_spec_is_a_one_line_error(value):
    result = _manage(worker_env(AGENTOPS_PAUSE_AT=value), "runworker", "--name", "bad-pause")

    assert result.returncode != 0
    line = one_line(result.stderr + result.stdout)
    assert line.startswith("CommandError: AGENTOPS_PAUSE_AT=")


def test_an_unreachable_database_is_a_one_line_error():
    url = f"postgres://postgres@127.0.0.1:{free_port()}/nowhere"
    env = worker_env(DATABASE_URL=url, AGENTOPS_STARTUP_DB_WAIT="0")
    result = _manage(env, "runworker", "--name", "no-db")

    assert result.returncode != 0
    line = one_line(result.stderr + result.stdout)
    assert line.startswith("CommandError: cannot reach the database")


def test_start_up_waits_for_an_unreachable_database_then_gives_up_with_one_line():
    url = f"postgres://postgres@127.0.0.1:{free_port()}/nowhere"
    env = worker_env(DATABASE_URL=url, AGENTOPS_STARTUP_DB_WAIT="1.5")
    started = time.monotonic()
    result = _manage(env, "runworker", "--name", "no-db")

    assert result.returncode == 1
    assert 1.5 <= time.monotonic() - started < 20
    waiting, gave_up = [line for line in (result.stderr + result.stdout).splitlines() if line]
    assert "WARNING" in waiting and "retrying for up to 1.5s" in waiting
    assert gave_up.startswith("CommandError: cannot reach the database")
    assert gave_up.endswith("(gave up after 1.5s)")


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


# --- a lost database connection -----------------------------------------------------------


def _postgresql_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("connections are terminated with pg_terminate_backend: PostgreSQL only")
    if settings.PG_POOLER == "transaction":
        # a server connection serves every client in turn (this test's own too): terminating
        # "the worker's" ends whoever's transaction runs on it next
        pytest.skip("backends are terminated by application name: not behind a transaction pooler")


def _terminate_connections(application_name: str) -> int:
    """What an administrator's pg_terminate_backend, or a failover, does to a worker."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s "
            "AND pid <> pg_backend_pid()",
            [application_name],
        )
        return cursor.fetchone()[0]


@slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_outlives_its_database_connections_being_terminated(
    worker_procs, sandbox, system_actor
):
    _postgresql_only()
    application_name = f"agentops-test-{uuid.uuid4().hex[:8]}"
    env = worker_env(sandbox)
    env["DATABASE_URL"] += f"{'&' if '?' in env['DATABASE_URL'] else '?'}"
    env["DATABASE_URL"] += f"application_name={application_name}"
    worker = worker_procs.start("cut-off", env)
    worker.wait_running()
    boot_id = Worker.objects.get(name="cut-off").boot_id

    # every connection of the worker (main process, pusher, monitor, task processes), again
    # and again: idle, mid-tick, mid-poll
    terminated = 0
    for pause in [0.1, 0.3, 0.05, 0.5, 0.2, 0.15, 0.4, 0.25, 0.05, 0.35] * 2:
        terminated += _terminate_connections(application_name)
        time.sleep(pause)
        assert worker.alive, worker.output()
    assert terminated >= 10
    faults_ended = db_now()

    # still the same worker: its heartbeat goes on under the identity it had
    wait_for(
        lambda: Worker.objects.get(name="cut-off").heartbeat_at > faults_ended,
        5,
        what="a heartbeat after the faults",
    )
    assert Worker.objects.get(name="cut-off").boot_id == boot_id
    # and its cluster still takes work
    run = _refund_run(system_actor)
    wait_for(lambda: Run.objects.get(id=run.id).status in Run.TERMINAL, 30, what="the run to end")
    assert Run.objects.get(id=run.id).status == Run.Status.SUCCEEDED
    assert worker.alive
    output = worker.output()
    # the main loop said so in a line per outage, not a traceback per sweep hook; the pusher
    # did not stop for 10 s
    assert "sweep hook" not in output
    assert "Failed to pull task from broker" not in output
    assert "reincarnated pusher" not in output

    worker.process.send_signal(signal.SIGTERM)
    assert worker.wait_exit(10) == 0, worker.output()
    assert Worker.objects.get(name="cut-off").health == Worker.Health.STOPPED


class _LateDatabase:
    """A TCP relay to the test database that starts listening only when told to: for a worker
    it is a database that is not there yet, then is."""

    def __init__(self) -> None:
        db = connection.settings_dict
        self.target = (db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432))
        self.port = free_port()
        auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
        self.url = f"postgres://{auth}@127.0.0.1:{self.port}/{db['NAME']}"
        self.listener: socket.socket | None = None
        self.sockets: list[socket.socket] = []

    def come_up(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in [self.listener, *self.sockets]:
            if sock is not None:
                with suppress(OSError):
                    sock.close()


@slow
@pytest.mark.django_db(transaction=True)
def test_start_up_waits_for_a_database_that_is_not_there_yet(worker_procs):
    _postgresql_only()
    database = _LateDatabase()
    try:
        env = worker_env(DATABASE_URL=database.url, AGENTOPS_STARTUP_DB_WAIT="30")
        worker = worker_procs.start("early", env)
        wait_for(
            lambda: "retrying for up to 30s" in worker.output() or not worker.alive,
            10,
            what="the worker to wait for the database",
        )
        time.sleep(1)  # a few more tries
        assert worker.alive, worker.output()

        database.come_up()
        worker.wait_running(20)

        # one line while it waited, however many tries
        assert worker.output().count("cannot reach the database") == 1, worker.output()
        assert Worker.objects.get(name="early").pid == worker.pid
        worker.process.send_signal(signal.SIGTERM)
        assert worker.wait_exit(10) == 0, worker.output()
    finally:
        database.close()


@pytest.mark.django_db(transaction=True)
def test_the_main_loop_outlives_a_lost_connection_under_the_same_identity(monkeypatch, caplog):
    boot_id = workers.identity_acquire("flaky")
    real_heartbeat = workers.heartbeat
    heartbeats = []

    def heartbeat(name, boot):
        heartbeats.append(boot)
        if len(heartbeats) in (2, 3, 4):  # an outage of three ticks
            raise OperationalError("terminating connection due to administrator command")
        return real_heartbeat(name, boot)

    requested = {"stop": False}
    pauses = []

    def pause(seconds, requested):
        pauses.append(seconds)
        requested["stop"] = len(pauses) == 6

    monkeypatch.setattr(workers, "heartbeat", heartbeat)
    monkeypatch.setattr(runworker, "_pause", pause)
    with caplog.at_level(logging.INFO, logger="runs.worker"):
        assert runworker.Command()._loop("flaky", boot_id, requested) is True

    # it backed off while the database was away, then went back to its interval
    interval = settings.AGENTOPS["SWEEP_INTERVAL"]
    assert pauses == [interval, 0.5, 1.0, 2.0, interval, interval]
    assert heartbeats == [boot_id] * 6
    # one warning line for the outage, no traceback; a line when it was over
    problems = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert [record.getMessage() for record in problems] == [
        "worker flaky: cannot reach the database: terminating connection due to administrator "
        "command; retrying"
    ]
    assert problems[0].exc_info is None
    assert "worker flaky: the database answers again after" in caplog.text
    # the identity is still this process's, freshly heartbeaten
    worker = Worker.objects.get(name="flaky")
    assert worker.boot_id == boot_id
    assert (db_now() - worker.heartbeat_at).total_seconds() < 5
