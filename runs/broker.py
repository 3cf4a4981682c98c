"""django-q2's ORM broker, made to outlive a lost database connection (Q_CLUSTER
``broker_class``)."""

from __future__ import annotations

import logging
import time
from contextlib import suppress

from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django_q.brokers.orm import ORM
from django_q.conf import Conf

log = logging.getLogger(__name__)

# short: the pusher notices a stop only between polls
RETRY_MAX = 2.0


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

    def dequeue(self):
        try:
            tasks = super().dequeue()
        except (OperationalError, InterfaceError) as exc:
            # a task locked before the connection broke is delivered again after `retry`,
            # and its run re-enqueued by the sweeper long before that
            for conn in connections.all(initialized_only=True):
                with suppress(DatabaseError, InterfaceError):
                    conn.close()
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
