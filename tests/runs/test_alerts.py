"""Operator alerts (runs.alerts): emailed once per cause, never once per sweep or refresh."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.core import mail
from django.utils import timezone

from runs import alerts, outbox, sweeper
from runs.actors import Actor
from runs.models import Alert, OutboxMessage, Run, Worker
from runs.record.checkpoint import checkpoint
from runs.services import run_create, run_retry_recovery

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture(autouse=True)
def _patient_liveness(settings):
    # the test settings call a worker dead after 3 s without a heartbeat (for crash tests);
    # here a slow, busy test machine must not kill the "live" workers these tests make
    settings.AGENTOPS = {**settings.AGENTOPS, "WORKER_STALE_AFTER": 120.0}


@pytest.fixture(autouse=True)
def _fresh_throttles(monkeypatch):
    # the module keeps per-process throttles; each test starts as a fresh process
    monkeypatch.setattr(alerts, "_last_check", 0.0)
    monkeypatch.setattr(alerts, "_last_retry", 0.0)
    monkeypatch.setattr(alerts, "ALERT_LISTENERS", [])


@pytest.fixture
def operators(django_user_model):
    group = Group.objects.get(name="operator")
    users = []
    for name, email, active in [
        ("olga", "olga@example.com", True),
        ("oscar", "oscar@example.com", True),
        ("omar", "", True),  # no address: cannot be emailed
        ("otto", "otto@example.com", False),  # deactivated
    ]:
        user = django_user_model.objects.create_user(
            username=name, password="pw", email=email, is_active=active
        )
        user.groups.add(group)
        users.append(user)
    # a viewer with an address is not an operator
    viewer = django_user_model.objects.create_user(
        username="vera", password="pw", email="vera@example.com"
    )
    viewer.groups.add(Group.objects.get(name="viewer"))
    return users


@pytest.fixture
def live_worker():
    return _worker("w-live")


def _worker(name: str, *, heartbeat_ago: float = 0, health: str = Worker.Health.HEALTHY):
    now = timezone.now()
    return Worker.objects.create(
        name=name,
        host="host-a",
        pid=4242,
        boot_id=uuid.uuid4(),
        started_at=now - timedelta(minutes=5),
        heartbeat_at=now - timedelta(seconds=heartbeat_ago),
        health=health,
    )


def _park(run: Run, reason: str = Run.Reason.RECOVERY_LIMIT, detail: str = "recovered 11 times"):
    """What the engine does when a run needs a person (engine.park_needs_attention)."""
    with checkpoint(run.id, actor="worker:w-1", channel="worker") as cp:
        cp.event("run.needs_attention", reason=reason, detail=detail)
        cp.update(status=Run.Status.NEEDS_ATTENTION, reason_code=reason, reason_detail=detail)


def _new_run(actor) -> Run:
    return run_create(
        agent_name="refund",
        goal="Refund order 1001",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=actor,
    )


def _recipients() -> list[str]:
    return sorted(address for message in mail.outbox for address in message.to)


def test_a_run_needing_attention_emails_each_operator_once(
    operators, live_worker, system_actor, django_capture_on_commit_callbacks
):
    run = _new_run(system_actor)
    _park(run)

    for _ in range(5):  # five sweeps, in one or several workers, or page refreshes
        alerts.alerts_check()

    assert _recipients() == ["olga@example.com", "oscar@example.com"]
    message = mail.outbox[0]
    assert message.subject == f"[agentops] Run {str(run.id)[:8]} needs attention"
    assert "needs attention: recovery_limit" in message.body
    assert "recovered 11 times" in message.body
    assert f"/runs/{run.id}/" in message.body
    alert = Alert.objects.get()
    assert alert.kind == Alert.Kind.RUN_NEEDS_ATTENTION and alert.run_id == run.id
    assert alert.notified_at is not None and alert.resolved_at is None


def test_each_time_a_run_parks_is_its_own_cause(operators, live_worker, system_actor, operator):
    run = _new_run(system_actor)
    _park(run)
    alerts.alerts_check()
    assert len(mail.outbox) == 2

    # an operator retries it: the alert is resolved, not deleted
    run_retry_recovery(run_id=run.id, actor=Actor.for_user(operator, "web"))
    alerts.alerts_check()
    first = Alert.objects.get()
    assert first.resolved_at is not None
    assert len(mail.outbox) == 2

    # it parks again: a new cause, one more email each
    _park(run)
    alerts.alerts_check()
    alerts.alerts_check()
    assert len(mail.outbox) == 4
    assert Alert.objects.filter(run=run).count() == 2


def test_a_cause_already_alerted_elsewhere_is_not_sent_again(operators, live_worker, system_actor):
    run = _new_run(system_actor)
    _park(run)
    alerts.alerts_check()
    cause = Alert.objects.get().cause

    # the conditional insert: a second process that tries the same cause gets nothing
    assert alerts._create(cause=cause, kind=Alert.Kind.RUN_NEEDS_ATTENTION, detail="x") is None
    alerts.alerts_check()
    assert len(mail.outbox) == 2


def test_a_worker_that_stops_heartbeating_alerts_once_per_boot(operators, live_worker):
    dead = _worker("w-2", heartbeat_ago=600)

    alerts.alerts_check()
    alerts.alerts_check()

    assert len(mail.outbox) == 2
    assert mail.outbox[0].subject == "[agentops] Worker w-2 stopped"
    assert "stopped heartbeating" in mail.outbox[0].body
    alert = Alert.objects.get()
    assert alert.cause == f"worker_stopped:w-2:{dead.boot_id}"

    # it is restarted and dies again: a new boot, a new alert
    Worker.objects.filter(name="w-2").update(boot_id=uuid.uuid4(), heartbeat_at=timezone.now())
    alerts.alerts_check()
    assert Alert.objects.get().resolved_at is not None  # it heartbeats again
    Worker.objects.filter(name="w-2").update(heartbeat_at=timezone.now() - timedelta(hours=1))
    alerts.alerts_check()
    assert len(mail.outbox) == 4


def test_a_cleanly_stopped_worker_is_not_an_alert(operators, live_worker):
    _worker("w-2", heartbeat_ago=600, health=Worker.Health.STOPPED)
    alerts.alerts_check()
    assert mail.outbox == [] and not Alert.objects.exists()


def test_a_frozen_cluster_alerts_once(operators, live_worker):
    _worker("w-3", health=Worker.Health.FROZEN)
    Worker.objects.filter(name="w-3").update(detail="no task ran for 95s while 2 wait")
    alerts.alerts_check()
    alerts.alerts_check()
    assert len(mail.outbox) == 2
    assert mail.outbox[0].subject == "[agentops] Worker w-3 looks frozen"
    assert "no task ran for 95s while 2 wait" in mail.outbox[0].body


def test_no_live_worker_alerts_once_until_one_lives_again(operators):
    _worker("w-1", heartbeat_ago=600, health=Worker.Health.STOPPED)

    alerts.alerts_check()
    alerts.alerts_check()

    assert len(mail.outbox) == 2
    assert mail.outbox[0].subject == "[agentops] No worker is running"
    assert "python manage.py runworker" in mail.outbox[0].body
    assert Alert.objects.get().kind == Alert.Kind.NO_LIVE_WORKER

    # a worker starts: resolved; it stops again later: a new episode, a new alert
    live = _worker("w-4")
    alerts.alerts_check()
    assert Alert.objects.get(kind=Alert.Kind.NO_LIVE_WORKER).resolved_at is not None
    Worker.objects.filter(name=live.name).update(
        health=Worker.Health.STOPPED, heartbeat_at=timezone.now()
    )
    alerts.alerts_check()
    assert Alert.objects.filter(kind=Alert.Kind.NO_LIVE_WORKER).count() == 2
    assert len(mail.outbox) == 4


def test_listeners_hear_each_alert_once_and_one_failing_stops_nothing(
    operators, live_worker, system_actor, monkeypatch
):
    heard: list[str] = []

    def broken(alert):
        raise RuntimeError("webhook endpoint down")

    monkeypatch.setattr(alerts, "ALERT_LISTENERS", [broken, lambda a: heard.append(a.cause)])
    run = _new_run(system_actor)
    _park(run)

    alerts.alerts_check()
    alerts.alerts_check()

    assert heard == [Alert.objects.get().cause]
    assert len(mail.outbox) == 2


def test_a_failed_send_is_retried_by_the_outbox(operators, live_worker, system_actor, monkeypatch):
    run = _new_run(system_actor)
    _park(run)

    def refuse(self, messages):
        raise ConnectionRefusedError("smtp down")

    with monkeypatch.context() as patch:
        patch.setattr("django.core.mail.backends.locmem.EmailBackend.send_messages", refuse)
        assert alerts.alerts_check() == 0
    alert = Alert.objects.get()
    assert alert.notified_at is not None  # its emails are in the outbox
    rows = OutboxMessage.objects.filter(kind="alert")
    assert sorted(r.to_address for r in rows) == ["olga@example.com", "oscar@example.com"]
    assert all((r.status, r.attempts) == ("pending", 1) for r in rows)

    # not again at once (the backoff), and the alert is not enqueued twice
    assert alerts.alerts_check() == 0
    assert outbox.outbox_drain_due() == 0
    assert mail.outbox == []
    # once the backoff has passed, the sweeper's drain sends them, once
    rows.update(next_attempt_at=timezone.now() - timedelta(seconds=1))
    assert outbox.outbox_drain_due() == 2
    assert _recipients() == ["olga@example.com", "oscar@example.com"]
    assert outbox.outbox_drain_due() == 0
    assert len(mail.outbox) == 2


def test_an_alert_whose_creator_died_before_enqueueing_is_enqueued_later(
    operators, live_worker, system_actor, monkeypatch
):
    run = _new_run(system_actor)
    _park(run)
    with monkeypatch.context() as patch:
        # the process died between the alert's insert and the enqueue
        patch.setattr(alerts, "_notify", lambda new: 0)
        alerts.alerts_check()
    alert = Alert.objects.get()
    assert alert.notified_at is None and mail.outbox == []

    assert alerts.alerts_check() == 0  # too soon: its creator may be enqueueing it
    Alert.objects.filter(id=alert.id).update(created_at=timezone.now() - timedelta(minutes=5))
    monkeypatch.setattr(alerts, "_last_retry", 0.0)
    assert alerts.alerts_check() == 1
    assert _recipients() == ["olga@example.com", "oscar@example.com"]
    monkeypatch.setattr(alerts, "_last_retry", 0.0)
    alerts.alerts_check()
    assert len(mail.outbox) == 2


def test_the_sweeper_runs_the_alert_check(operators, live_worker, system_actor, settings):
    settings.AGENTOPS = {**settings.AGENTOPS, "ALERT_INTERVAL": 5.0}
    assert alerts.alerts_sweep in sweeper._hooks
    run = _new_run(system_actor)
    _park(run)

    sweeper.sweep()
    sweeper.sweep()  # within ALERT_INTERVAL: not even checked again

    assert len(mail.outbox) == 2


def test_an_interval_of_zero_turns_the_sweepers_alerts_off(operators, system_actor, settings):
    settings.AGENTOPS = {**settings.AGENTOPS, "ALERT_INTERVAL": 0}
    _park(_new_run(system_actor))
    sweeper.sweep()
    assert mail.outbox == [] and not Alert.objects.exists()


def test_no_operator_with_an_address_still_records_the_alert(live_worker, system_actor):
    run = _new_run(system_actor)
    _park(run)
    alerts.alerts_check()
    assert mail.outbox == []
    assert Alert.objects.get().run_id == run.id


def test_the_check_alerts_command_finds_a_cluster_with_no_worker(operators):
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("check_alerts", stdout=out)
    call_command("check_alerts", stdout=out)
    assert out.getvalue() == "1 alert(s) sent\n0 alert(s) sent\n"
    assert [m.subject for m in mail.outbox] == ["[agentops] No worker is running"] * 2


def test_many_causes_at_once_make_one_digest_not_a_storm(operators, system_actor):
    runs = [_new_run(system_actor) for _ in range(5)]
    for run in runs:
        _park(run)
    _worker("w-gone", heartbeat_ago=600)  # and no live worker at all

    assert alerts.alerts_check() == 7
    alerts.alerts_check()

    assert _recipients() == ["olga@example.com", "oscar@example.com"]
    digest = mail.outbox[0]
    assert digest.subject == "[agentops] 7 alerts: 5 runs need attention, 2 worker problems"
    for run in runs:
        assert f"Run {str(run.id)[:8]} needs attention: " in digest.body
        assert f"/runs/{run.id}/" in digest.body
    assert "Worker w-gone stopped" in digest.body and "No worker is running" in digest.body
    assert Alert.objects.filter(notified_at__isnull=True).count() == 0
