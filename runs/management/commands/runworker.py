"""``python manage.py runworker [--name NAME]``: a worker that advances runs.

Holds its identity exclusively, takes over the leases of its own dead predecessor at once,
sweeps orphaned runs, then starts the django-q2 cluster and keeps sweeping and checking
liveness from this main process until SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import OperationalError, connections

from runs import faults, sweeper, workers

log = logging.getLogger("runs.worker")


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
        try:
            boot_id = workers.identity_acquire(name)
        except workers.IdentityHeld as exc:
            raise CommandError(str(exc)) from None
        except OperationalError as exc:
            raise CommandError(
                f"cannot reach the database: {str(exc).strip().splitlines()[0]}"
            ) from None
        taken = workers.take_over_predecessor(name)
        enqueued = sweeper.sweep()
        log.info("worker %s started (took over %d leases, enqueued %d runs)", name, taken, enqueued)

        os.environ["AGENTOPS_WORKER_NAME"] = name
        stopping = {"flag": False}
        cluster = None
        if not options["no_cluster"]:
            from django_q.cluster import Cluster

            # the forked cluster processes must not share this process's connections
            connections.close_all()
            cluster = Cluster()
            cluster.start()

        def request_stop(signum, frame):
            stopping["flag"] = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        self.stdout.write(f"worker {name} running (pid {os.getpid()})")
        self.stdout.flush()
        try:
            self._loop(name, boot_id, stopping)
        finally:
            if cluster is not None:
                cluster.stop()
            workers.identity_release(name, boot_id)
            self.stdout.write(f"worker {name} stopped")

    def _loop(self, name, boot_id, stopping) -> None:
        from django_q.brokers import get_broker
        from django_q.tasks import async_task

        conf = settings.AGENTOPS
        interval = conf["SWEEP_INTERVAL"]
        started = time.monotonic()
        last_canary = 0.0
        broker = get_broker()
        while not stopping["flag"]:
            try:
                if not workers.heartbeat(name, boot_id):
                    log.error("worker %s: another process took this identity; stopping", name)
                    return
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
            except OperationalError:
                # the database is unreachable: keep trying; runs are safe in their record
                log.exception("worker %s: database error in the sweeper", name)
            deadline = time.monotonic() + interval
            while not stopping["flag"] and time.monotonic() < deadline:
                time.sleep(min(0.05, interval))
