"""``/healthz``, ``/healthz/workers`` and ``/metrics`` (runs/health.py, runs/metrics.py):
who may read them, and what a scrape shows while a real worker drives a real run."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.db import OperationalError, connection
from prometheus_client.parser import text_string_to_metric_families

from approvals.models import Approval
from approvals.services import approval_decide
from runs import engine
from runs.actors import Actor
from runs.models import Run, RunEvent, Worker
from runs.registry import registry
from runs.services import run_create
from tests.conftest import drive
from tests.runs.workerprocs import wait_for, worker_env
from tests.support import expire_lease

SMALL = {"order_id": "ord_1002", "amount_cents": 700}
LARGE = {"order_id": "ord_1004", "amount_cents": 20_000}  # waits for an approver


def scrape(client, **headers: Any) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed with prometheus_client's own parser: (sample, labels) -> value."""
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


# --- /healthz --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_healthz_says_ok_when_the_database_answers(client):
    response = client.get("/healthz")

    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok"}
    assert "no-cache" in response["Cache-Control"]


@pytest.mark.django_db
def test_healthz_is_503_when_the_database_does_not_answer(client, monkeypatch):
    def broken_cursor(*args, **kwargs):
        raise OperationalError("connection refused")

    monkeypatch.setattr(connection, "cursor", broken_cursor)

    response = client.get("/healthz")

    assert response.status_code == 503
    assert response.json() == {"status": "error", "database": "unavailable"}


@pytest.mark.django_db
def test_healthz_rejects_post(client):
    assert client.post("/healthz").status_code == 405


# --- who may read /metrics and /healthz/workers --------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/metrics", "/healthz/workers"])
def test_a_client_outside_the_allowed_networks_is_refused(client, path):
    response = client.get(path, REMOTE_ADDR="203.0.113.7")

    assert response.status_code == 403
    assert response.json()["code"] == "forbidden"


@pytest.mark.django_db
def test_a_request_forwarded_by_a_local_proxy_is_not_taken_for_a_local_client(client):
    response = client.get("/metrics", REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="203.0.113.7")

    assert response.status_code == 403


@pytest.mark.django_db
def test_the_bearer_token_lets_any_address_scrape(client, monkeypatch):
    monkeypatch.setitem(settings.AGENTOPS_METRICS, "TOKEN", "s3cret-metrics-token")
    monkeypatch.setitem(settings.AGENTOPS_METRICS, "ALLOWED_NETWORKS", [])

    good = client.get(
        "/metrics", REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION="Bearer s3cret-metrics-token"
    )
    wrong = client.get("/metrics", REMOTE_ADDR="127.0.0.1", HTTP_AUTHORIZATION="Bearer nope")
    without = client.get("/metrics", REMOTE_ADDR="127.0.0.1")

    assert good.status_code == 200
    assert (wrong.status_code, without.status_code) == (403, 403)


# --- what a scrape shows -------------------------------------------------------------------------


@pytest.mark.django_db
def test_runs_by_status_steps_and_the_step_histogram_follow_the_record(
    client, sandbox, system_actor
):
    before = scrape(client)
    finished = run_create(agent_name="refund", input=SMALL, actor=system_actor)
    run_create(agent_name="refund", input=SMALL, actor=system_actor)  # left queued
    drive(finished.id)

    after = scrape(client)

    assert value(after, "agentops_runs", status="succeeded") == 1
    assert value(after, "agentops_runs", status="queued") == 1
    assert value(after, "agentops_steps_total") - value(before, "agentops_steps_total") == 3
    # lookup + refund + finish, all completed within the window
    assert value(after, "agentops_step_duration_seconds_bucket", le="+Inf") == 3
    assert value(after, "agentops_step_duration_seconds_gcount") == 3
    assert value(after, "agentops_step_duration_seconds_bucket", le="300.0") == 3  # all quick
    assert 0 < value(after, "agentops_step_duration_seconds_gsum") < 300 * 3
    # this process committed checkpoints: its own latency histogram saw them
    assert value(after, "agentops_checkpoint_seconds_count") > value(
        before, "agentops_checkpoint_seconds_count"
    )


@pytest.mark.django_db(transaction=True)
def test_a_lost_lease_is_recorded_and_counted(client, sandbox, system_actor, monkeypatch):
    run = run_create(agent_name="refund", input=SMALL, actor=system_actor)
    agent = registry.agent("refund")
    original = type(agent).decide

    def stall_past_the_lease(ctx):
        if ctx.steps:
            expire_lease(ctx.run_id)
            assert engine.claim(ctx.run_id, worker="w2") is not None
        return original(agent, ctx)

    monkeypatch.setattr(agent, "decide", stall_past_the_lease)

    assert engine.advance(run.id, worker="w1") == "lease_lost"

    lost = RunEvent.objects.get(run=run, type="run.lease_lost")
    assert (lost.actor, lost.payload["lost_fence"]) == ("worker:w1", 1)
    assert value(scrape(client), "agentops_lease_losses_total") == 1
    # the note changed nothing the new holder relies on
    run.refresh_from_db()
    assert (run.fence, run.lease_owner) == (2, "w2")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("roles")
def test_scraping_during_a_real_run_shows_the_counters_moving(
    client, worker_procs, sandbox, system_actor, approver
):
    worker = worker_procs.start("metrics-1", worker_env(sandbox))
    worker.wait_running()
    run = run_create(agent_name="refund", input=LARGE, actor=system_actor)
    wait_for(
        lambda: Run.objects.get(id=run.id).status == Run.Status.WAITING_APPROVAL,
        30,
        what="the run to wait for its approval",
    )

    wait_for(
        lambda: Worker.objects.get(name="metrics-1").health == Worker.Health.HEALTHY,
        30,
        what="the worker's first liveness check",
    )

    waiting = scrape(client)

    assert value(waiting, "agentops_runs", status="waiting_approval") == 1
    assert value(waiting, "agentops_approvals_pending") == 1
    assert value(waiting, "agentops_tool_calls_open", status="awaiting_approval") == 1
    assert value(waiting, "agentops_worker_health", worker="metrics-1", health="healthy") == 1
    heartbeat_age = value(
        waiting, "agentops_worker_heartbeat_age_seconds", worker="metrics-1", host=_host()
    )
    assert 0 <= heartbeat_age < settings.AGENTOPS["WORKER_STALE_AFTER"]
    workers = client.get("/healthz/workers")
    assert workers.status_code == 200
    assert [w["name"] for w in workers.json()["workers"] if w["alive"]] == ["metrics-1"]

    approval = Approval.objects.get(run=run)
    approval_decide(
        approval_id=approval.id, decision="approve", actor=Actor.for_user(approver, "web")
    )
    wait_for(
        lambda: Run.objects.get(id=run.id).status == Run.Status.SUCCEEDED,
        30,
        what="the run to succeed",
    )

    done = scrape(client)

    assert value(done, "agentops_runs", status="succeeded") == 1
    assert value(done, "agentops_runs", status="waiting_approval") == 0
    assert value(done, "agentops_approvals_pending") == 0
    assert value(done, "agentops_approvals_settled_total", status="approved") == 1
    assert value(done, "agentops_steps_total") > value(waiting, "agentops_steps_total")
    assert value(done, "agentops_step_duration_seconds_bucket", le="+Inf") == 3


def _host() -> str:
    import socket

    return socket.gethostname()


@pytest.mark.django_db
def test_workers_health_is_503_when_no_worker_is_alive(client):
    response = client.get("/healthz/workers")

    assert response.status_code == 503
    assert response.json()["problem"].startswith("no live worker")


@pytest.mark.django_db
def test_a_frozen_worker_makes_workers_health_fail_and_is_named(client):
    from runs.dbtime import db_now

    now = db_now()
    for name, health in (("w-ok", "healthy"), ("w-stuck", "frozen")):
        Worker.objects.create(
            name=name, host="h", pid=1, started_at=now, heartbeat_at=now, health=health
        )

    response = client.get("/healthz/workers")

    assert response.status_code == 503
    assert response.json()["problem"] == "frozen: w-stuck (restart them)"
    scraped = scrape(client)
    assert value(scraped, "agentops_workers", health="frozen") == 1
    assert value(scraped, "agentops_worker_health", worker="w-stuck", health="frozen") == 1


@pytest.mark.django_db
def test_a_scrape_without_a_database_is_503_not_a_stack_trace(client, monkeypatch):
    from runs import metrics

    def no_database():
        raise OperationalError("the database system is shutting down")

    monkeypatch.setattr(metrics, "exposition", no_database)

    response = client.get("/metrics")

    assert response.status_code == 503
    assert response.json() == {"status": "error", "database": "unavailable"}


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/healthz", "/metrics"])
def test_probes_answer_a_host_header_that_is_not_an_allowed_host(client, path):
    """Load balancers and Prometheus address a machine by its IP: not in ALLOWED_HOSTS."""
    response = client.get(path, HTTP_HOST="10.1.2.3:8000")

    assert response.status_code == 200
    # everything else still refuses such a host
    assert client.get("/accounts/login/", HTTP_HOST="10.1.2.3:8000").status_code == 400
