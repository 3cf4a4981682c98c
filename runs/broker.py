"""django-q2's ORM broker, made to outlive a lost database connection (Q_CLUSTER
``broker_class``)."""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from datetime import timedelta

from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django.utils import timezone
from django_q.brokers.orm import ORM
from django_q.conf import Conf
from django_q.models import OrmQ

log = logging.getLogger(__name__)

# short: the pusher notices a stop only between polls
RETRY_MAX = 2.0


def _close_all() -> None:
    for conn in connections.all(initialized_only=True):
        with suppress(DatabaseError, InterfaceError):
            conn.close()


class OrmBroker(ORM):
    """The cluster's pusher process polls ``dequeue``; when that raises, django-q2 logs a
    traceback, sleeps 10 s and lets the pusher die for the sentinel to start another. One
    terminated connection (a failover, a restart, pg_terminate_backend) would stop the worker
    from taking tasks for 10 s, long enough to look frozen. Here a failed poll drops the
    connection, says so once per outage, waits a little longer each time and returns nothing;
    the next poll reconnects."""

    # class defaults: a broker is pickled into the cluster's processes without its state
    _failing_since: float | None = None
    _retry_delay = 0.0

    @staticmethod
    def get_connection(list_key: str | None = None):
        # called when each cluster process builds its broker (the sentinel's first): a
        # connection terminated while it opens (a failover, pg_terminate_backend) would kill
        # the sentinel and the worker with it, the cluster never started. Retried briefly.
        for attempt in range(1, 6):
            try:
                queryset = ORM.get_connection(list_key)
                break
            except (OperationalError, InterfaceError):
                _close_all()
                if attempt == 5:
                    raise
                log.warning("broker: the database connection failed while opening; retrying")
                time.sleep(0.2 * attempt)
        # django-q2 calls close_old_connections() before every broker call, which makes the
        # next query run Django's health check (SELECT 1) first: three more round trips per
        # task. A connection that broke is dealt with where it breaks instead (dequeue and
        # acknowledge here); connections past CONN_MAX_AGE are still closed.
        connections[Conf.ORM].health_check_done = True
        return queryset

    def acknowledge(self, task_id):
        try:
            return super().acknowledge(task_id)
        except (OperationalError, InterfaceError):
            # once more on a new connection (else the monitor dies, and the task is handed
            # out again after `retry`: a duplicate wake-up, harmless but late)
            _close_all()
            return super().acknowledge(task_id)

    def _take(self):
        """PostgreSQL: the next tasks taken in ONE statement that skips rows another cluster
        is taking (django-q2: a SELECT, then an UPDATE per task that may lose the race to
        the other worker's pusher — at every task, with two workers)."""
        connection = connections[Conf.ORM]
        if connection.vendor != "postgresql":
            return super().dequeue()
        self.get_connection()
        q = connection.ops.quote_name
        table, pk, key, lock = q(OrmQ._meta.db_table), q("id"), q("key"), q("lock")
        now = timezone.now()
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET {lock} = %s WHERE {pk} IN (SELECT {pk} FROM {table} "
                f"WHERE {key} = %s AND {lock} < %s ORDER BY {pk} LIMIT %s "
                f"FOR UPDATE SKIP LOCKED) RETURNING {pk}, {q('payload')}",
                [now + timedelta(seconds=Conf.RETRY), self.list_key, now, Conf.BULK],
            )
            tasks = cursor.fetchall()
        if tasks:
            return tasks
        time.sleep(Conf.POLL)  # an empty queue: spare the CPU, as django-q2 does
        return None

    def dequeue(self):
        try:
            tasks = self._take()
        except (OperationalError, InterfaceError) as exc:
            # a task locked before the connection broke is delivered again after `retry`,
            # and its run re-enqueued by the sweeper long before that
            _close_all()
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                self._retry_delay = max(Conf.POLL, 0.5)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                log.warning("task pusher: cannot reach the database: %s; retrying", first)
            else:
                self._retry_delay = min(self._retry_delay * 2, RETRY_MAX)
            time.sleep(self._retry_delay)
            return None
        if self._failing_since is not None:
            log.info(
                "task pusher: the database answers again after %.1fs",
                time.monotonic() - self._failing_since,
            )
            self._failing_since = None
        return tasks
