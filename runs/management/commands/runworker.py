"""``python manage.py runworker [--name NAME]``: a worker that advances runs.

Holds its identity exclusively, takes over the leases of its own dead predecessor at once,
sweeps orphaned runs, then starts the django-q2 cluster and keeps sweeping and checking
liveness from this main process until SIGTERM/SIGINT.

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

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, InterfaceError, connections

from runs import engine, faults, sweeper, workers

log = logging.getLogger("runs.worker")


def _database_problem(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if "no such table" in first or ("relation" in first and "does not exist" in first):
        return f"the database is not migrated (run python manage.py migrate): {first}"
    return f"cannot reach the database: {first}"


class Command(BaseCommand):
    help = "Run a worker: identity, recovery sweeper and the django-q2 cluster."

    def add_arguments(self, parser):
        parser.add_argument("--name", default=None, help="stable worker identity (default: host-1)")
        parser.add_argument(
            "--no-cluster",
            action="store_true",
            help="only sweep (no django-q2 cluster): for a dedicated sweeper process",
        )

    def handle(self, *args, **options):
        try:
            faults.parse_crash_spec(os.environ.get("AGENTOPS_CRASH_AT"))
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
        try:
            boot_id = workers.identity_acquire(name)
        except workers.IdentityHeld as exc:
            raise CommandError(str(exc)) from None
        except (DatabaseError, InterfaceError) as exc:
            raise CommandError(_database_problem(exc)) from None

        cluster = None
        lost_identity = False
        try:
            taken = workers.take_over_predecessor(name)
            enqueued = sweeper.sweep()
            log.info(
                "worker %s started (took over %d leases, enqueued %d runs)", name, taken, enqueued
            )
            os.environ["AGENTOPS_WORKER_NAME"] = name
            engine.set_stop_check(stopping.is_set)
            faults.share_counts()  # AGENTOPS_CRASH_AT=<boundary>:<n> counts the whole worker
            if not options["no_cluster"] and not requested["stop"]:
                from django_q.cluster import Cluster

                # the forked cluster processes must not share this process's connections
                connections.close_all()
                cluster = Cluster()
                # Cluster() installs its own handlers, which stop the cluster from inside a
                # signal handler; ours only set the flag and let the loop below stop it
                signal.signal(signal.SIGTERM, request_stop)
                signal.signal(signal.SIGINT, request_stop)
                cluster.start()
            self.stdout.write(f"worker {name} running (pid {os.getpid()})")
            self.stdout.flush()
            lost_identity = not self._loop(name, boot_id, requested)
        finally:
            stopping.set()
            if cluster is not None and cluster.sentinel is not None:
                cluster.stop()
            try:
                workers.identity_release(name, boot_id)
            except (DatabaseError, InterfaceError):
                log.warning("worker %s: could not release its identity; it goes stale", name)
        if lost_identity:
            raise CommandError(f"worker {name}: another process took this identity; stopped")
        self.stdout.write(f"worker {name} stopped")

    def _loop(self, name, boot_id, requested) -> bool:
        """Sweep, heartbeat and check liveness until asked to stop. False when another
        process has taken this worker's identity."""
        from django_q.brokers import get_broker
        from django_q.tasks import async_task

        conf = settings.AGENTOPS
        interval = conf["SWEEP_INTERVAL"]
        started = time.monotonic()
        last_canary = 0.0
        broker = get_broker()
        while not requested["stop"]:
            try:
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
                # the database is unreachable: keep trying; runs are safe in their record
                log.error("worker %s: %s; retrying", name, _database_problem(exc))
                connections.close_all()
            deadline = time.monotonic() + interval
            while not requested["stop"] and time.monotonic() < deadline:
                time.sleep(min(0.05, interval))
        return True
