"""``python manage.py runworker [--name NAME]``: a worker that advances runs.

Holds its identity exclusively, takes over (and wakes) the runs of its own dead predecessor
at once, starts the django-q2 cluster, then sweeps orphaned runs and checks liveness from
this main process until SIGTERM/SIGINT. A lost database connection is not
fatal: start-up retries it for up to ``AGENTOPS_STARTUP_DB_WAIT`` seconds (then exits 1 with
one line), and the main loop retries it for as long as it runs, keeping its identity.

Stopping: SIGTERM (or SIGINT) to THIS process only. The slices in progress yield at their
next step boundary, the cluster stops, the identity is released and the leases it still
held are freed for other workers at once. (SIGTERM to the whole process group hangs a
django-q2 cluster for about 90 s; SIGKILL of the group is a crash, which is recovered.)
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from contextlib import suppress
from typing import TypeVar

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connections,
)

from runs import engine, faults, sweeper, workers
from runs.registry import registry

log = logging.getLogger("runs.worker")

T = TypeVar("T")

# A lost connection (a failover, a PostgreSQL restart, an administrator's
# pg_terminate_backend) costs this process a tick, not its life: the broken connection is
# dropped, and the next try opens a fresh one after a pause that doubles up to RETRY_MAX
# while the database stays away.
RETRY_FIRST = 0.5
RETRY_MAX = 5.0


class _Stopped(Exception):
    """SIGTERM or SIGINT arrived while start-up waited for the database."""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _unmigrated(exc: BaseException) -> bool:
    first = _first_line(exc)
    return "no such table" in first or ("relation" in first and "does not exist" in first)


def _connection_lost(exc: BaseException) -> bool:
    """Worth another try on a fresh connection (SQLite's "database is locked" too); a
    missing table or a bad query is not."""
    return isinstance(exc, OperationalError | InterfaceError) and not _unmigrated(exc)


def _database_problem(exc: BaseException) -> str:
    first = _first_line(exc)
    if "prepared statement" in first and "does not exist" in first:
        # the statement was prepared on another server connection: a transaction pooler
        return (
            f"{first}: a transaction pooler (PgBouncer's pool_mode = transaction) sits "
            "between this process and PostgreSQL; set AGENTOPS_PG_POOLER=transaction"
        )
    if _unmigrated(exc):
        return f"the database is not migrated (run python manage.py migrate): {first}"
    if _connection_lost(exc):
        return f"cannot reach the database: {first}"
    return f"database error: {first}"


def _drop_connections() -> None:
    """Close this process's connections: a broken one must not be used again."""
    for conn in connections.all(initialized_only=True):
        with suppress(DatabaseError, InterfaceError):
            conn.close()


def _pause(seconds: float, requested: dict[str, bool]) -> None:
    """Sleep, but wake up for SIGTERM/SIGINT within 50 ms."""
    end = time.monotonic() + seconds
    while not requested["stop"] and time.monotonic() < end:
        time.sleep(min(0.05, seconds))


class Command(BaseCommand):
    help = "Run a worker: identity, recovery sweeper and the django-q2 cluster."
    # Django's system checks (URLs, admin, templates, DRF: about 0.3 s) are for a release
    # (`manage.py check --deploy`) and the test suite, as gunicorn does not run them either:
    # a worker restarted after a crash is back without them (cold start, docs/benchmarks.md)
    requires_system_checks: list[str] = []

    def add_arguments(self, parser):
        parser.add_argument("--name", default=None, help="stable worker identity (default: host-1)")
        parser.add_argument(
            "--no-cluster",
            action="store_true",
            help="only sweep (no django-q2 cluster): for a dedicated sweeper process",
        )

    def handle(self, *args, **options):
        try:
            faults.check_environment()
        except faults.BadCrashSpec as exc:
            raise CommandError(str(exc)) from None
        name = options["name"] or workers.default_worker_name()

        # The signal handler only sets a flag (it may interrupt this process anywhere,
        # even inside a lock); the loop passes it on to ``stopping``, which the forked
        # cluster processes share: a slice in progress then yields at its next step
        # boundary instead of running out its budget.
        requested = {"stop": False}
        stopping = multiprocessing.get_context("fork").Event()

        def request_stop(signum, frame):
            requested["stop"] = True

        # installed before anything slow, so an early SIGTERM still stops cleanly
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        # the database may still be starting (a host boot, a failover): start-up waits for
        # it this long in all
        self._start_deadline = time.monotonic() + settings.AGENTOPS["STARTUP_DB_WAIT"]
        self._start_waiting = False
        try:
            boot_id = self._at_start(name, requested, lambda: workers.identity_acquire(name))
        except workers.IdentityHeld as exc:
            raise CommandError(str(exc)) from None
        except _Stopped:
            self.stdout.write(f"worker {name} stopped")
            return

        cluster = None
        lost_identity = False
        try:
            # the predecessor's runs are woken here, before the cluster starts, so its first
            # poll finds them; the first sweep (orphans of other workers, due timers, the
            # hooks) is the main loop's first tick, right after the cluster started: a sweep
            # always runs beside a cluster, and nothing the cluster does waits for it
            taken = self._at_start(name, requested, lambda: workers.take_over_predecessor(name))
            log.info("worker %s started (took over and woke %d runs)", name, taken)
            if connections["default"].vendor == "postgresql" and settings.PG_POOLER != "none":
                log.info("worker %s: PostgreSQL through a %s pooler", name, settings.PG_POOLER)
            registry.warn_unguarded(log)
            os.environ["AGENTOPS_WORKER_NAME"] = name
            engine.set_stop_check(stopping.is_set)
            faults.share_counts()  # AGENTOPS_CRASH_AT=<boundary>:<n> counts the whole worker
            if not options["no_cluster"] and not requested["stop"]:
                from django_q.cluster import Cluster

                # the forked cluster processes must not share this process's connections
                _drop_connections()
                cluster = Cluster()
                # Cluster() installs its own handlers, which stop the cluster from inside a
                # signal handler; ours only set the flag and let the loop below stop it
                signal.signal(signal.SIGTERM, request_stop)
                signal.signal(signal.SIGINT, request_stop)
                cluster.start()
            self.stdout.write(f"worker {name} running (pid {os.getpid()})")
            self.stdout.flush()
            lost_identity = not self._loop(name, boot_id, requested)
        except _Stopped:
            pass
        finally:
            stopping.set()
            if cluster is not None and cluster.sentinel is not None:
                cluster.stop()
            self._release(name, boot_id)
        if lost_identity:
            raise CommandError(f"worker {name}: another process took this identity; stopped")
        self.stdout.write(f"worker {name} stopped")

    def _at_start(self, name: str, requested: dict[str, bool], step: Callable[[], T]) -> T:
        """One start-up step, tried again on a fresh connection while the database cannot be
        reached, until STARTUP_DB_WAIT after start-up began; then one line and exit 1."""
        delay = RETRY_FIRST
        while True:
            try:
                return step()
            except (DatabaseError, InterfaceError) as exc:
                _drop_connections()
                if not _connection_lost(exc):
                    raise CommandError(_database_problem(exc)) from None
                left = self._start_deadline - time.monotonic()
                if left <= 0:
                    waited = settings.AGENTOPS["STARTUP_DB_WAIT"]
                    raise CommandError(
                        f"{_database_problem(exc)} (gave up after {waited:g}s)"
                    ) from None
                if not self._start_waiting:
                    self._start_waiting = True
                    log.warning(
                        "worker %s: %s; retrying for up to %gs",
                        name,
                        _database_problem(exc),
                        settings.AGENTOPS["STARTUP_DB_WAIT"],
                    )
            _pause(min(delay, left), requested)
            if requested["stop"]:
                raise _Stopped
            delay = min(delay * 2, RETRY_MAX)

    def _release(self, name: str, boot_id) -> None:
        # a second try on a fresh connection: the one from the last tick may be gone
        for _ in range(2):
            try:
                workers.identity_release(name, boot_id)
                return
            except (DatabaseError, InterfaceError):
                _drop_connections()
        log.warning("worker %s: could not release its identity; it goes stale", name)

    def _loop(self, name, boot_id, requested) -> bool:
        """Sweep, heartbeat and check liveness until asked to stop. False when another
        process has taken this worker's identity.

        A database that cannot be reached costs ticks, never the worker: it keeps its
        identity and tries again. Its runs are safe in their record meanwhile; if the
        outage outlasts LEASE_TTL their leases expire and other workers take them over, as
        designed."""
        from django_q.brokers import get_broker
        from django_q.tasks import async_task

        conf = settings.AGENTOPS
        interval = conf["SWEEP_INTERVAL"]
        started = time.monotonic()
        last_canary = 0.0
        broker = get_broker()
        failing_since: float | None = None  # the first failed tick of the current outage
        delay = RETRY_FIRST
        while not requested["stop"]:
            pause = interval
            try:
                # as Django does before each request: a connection the server closed since
                # the last tick (pg_terminate_backend, a restart) is replaced here, by the
                # health check, rather than failing the heartbeat
                close_old_connections()
                if not workers.heartbeat(name, boot_id):
                    log.error("worker %s: another process took this identity; stopping", name)
                    return False
                sweeper.sweep()
                now = time.monotonic()
                if now - last_canary >= conf["CANARY_INTERVAL"]:
                    async_task("runs.tasks.canary", name)
                    last_canary = now
                    workers.check_liveness(
                        name,
                        boot_id,
                        pending_tasks=broker.queue_size() or 0,
                        started=started,
                        now=now,
                    )
            except (DatabaseError, InterfaceError) as exc:
                _drop_connections()
                if failing_since is None:
                    failing_since = time.monotonic()
                    delay = RETRY_FIRST
                    # one line per outage, not one per tick
                    log.warning("worker %s: %s; retrying", name, _database_problem(exc))
                else:
                    delay = min(delay * 2, RETRY_MAX)
                pause = max(interval, delay)
            else:
                if failing_since is not None:
                    log.info(
                        "worker %s: the database answers again after %.1fs",
                        name,
                        time.monotonic() - failing_since,
                    )
                    failing_since = None
            _pause(pause, requested)
        return True
