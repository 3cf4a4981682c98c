"""The cluster's broker: django-q2's ORM broker, except that a poll on a lost database
connection does not stop the pusher (django-q2 would let it die after a 10 s sleep)."""

from __future__ import annotations

import logging

import pytest
from django.db import OperationalError
from django_q.brokers import get_broker
from django_q.brokers.orm import ORM

from runs import broker as broker_module
from runs.broker import OrmBroker


@pytest.mark.django_db
def test_the_cluster_uses_the_broker_that_outlives_a_lost_connection():
    assert isinstance(get_broker(), OrmBroker)


@pytest.mark.django_db(transaction=True)
def test_a_poll_on_a_lost_connection_returns_nothing_and_the_next_one_reconnects(
    monkeypatch, caplog
):
    broker = get_broker()
    real_take = OrmBroker._take
    polls = []

    def take(self):
        polls.append(self)
        if len(polls) <= 3:  # the database is away for three polls
            raise OperationalError("terminating connection due to administrator command")
        return real_take(self)

    sleeps = []
    monkeypatch.setattr(OrmBroker, "_take", take)
    monkeypatch.setattr(broker_module.time, "sleep", sleeps.append)
    broker.enqueue("a signed task")

    with caplog.at_level(logging.INFO, logger="runs.broker"):
        assert [broker.dequeue() for _ in range(3)] == [None, None, None]
        tasks = broker.dequeue()

    assert [payload for _, payload in tasks] == ["a signed task"]
    # waiting a little longer each time, not django-q2's 10 s
    assert sleeps == [0.5, 1.0, 2.0]
    # one line for the outage and one when it is over, no traceback
    problems = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert [record.getMessage() for record in problems] == [
        "task pusher: cannot reach the database: terminating connection due to administrator "
        "command; retrying"
    ]
    assert problems[0].exc_info is None
    assert "task pusher: the database answers again after" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_each_waiting_task_is_handed_out_once_oldest_first():
    broker = get_broker()
    for payload in ("first", "second", "third"):
        broker.enqueue(payload)

    taken = [broker.dequeue() for _ in range(3)]

    assert [[payload for _, payload in tasks] for tasks in taken] == [
        ["first"],
        ["second"],
        ["third"],
    ]
    # handed out: locked until django-q2's retry, not handed out again meanwhile
    assert broker.queue_size() == 0
    assert broker.lock_size() == 3


@pytest.mark.django_db(transaction=True)
def test_an_acknowledgement_on_a_lost_connection_is_made_on_a_new_one(monkeypatch):
    broker = get_broker()
    broker.enqueue("done")
    ((task_id, _payload),) = broker.dequeue()
    real_delete = ORM.delete
    calls = []

    def delete(self, task_id):
        calls.append(task_id)
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return real_delete(self, task_id)

    monkeypatch.setattr(ORM, "delete", delete)

    broker.acknowledge(task_id)

    assert calls == [task_id, task_id]
    assert broker.queue_size() + broker.lock_size() == 0


@pytest.mark.django_db(transaction=True)
def test_a_connection_terminated_while_the_broker_opens_is_retried(monkeypatch):
    """The chaos harness's database faults once terminated the connection a restarting
    worker's sentinel was opening: the sentinel died, and the worker with it. Building the
    broker retries instead."""
    real = ORM.get_connection
    attempts = []

    def get_connection(list_key=None):
        attempts.append(list_key)
        if len(attempts) <= 2:
            raise OperationalError("terminating connection due to administrator command")
        return real(list_key)

    monkeypatch.setattr(ORM, "get_connection", staticmethod(get_connection))
    monkeypatch.setattr(broker_module.time, "sleep", lambda seconds: None)
    broker = get_broker()
    assert isinstance(broker, OrmBroker) and len(attempts) == 3
    broker.enqueue("a signed task")
    assert [payload for _, payload in broker.dequeue()] == ["a signed task"]
