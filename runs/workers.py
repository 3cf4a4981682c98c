"""Worker identity, takeover of a dead predecessor's leases, and cluster liveness."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from runs.dbtime import db_now
from runs.models import Run, Worker
from runs.queue import enqueue_on_commit
from runs.registry import registry

log = logging.getLogger(__name__)


class IdentityHeld(Exception):
    pass


def default_worker_name() -> str:
    return f"{socket.gethostname()}-1"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def identity_acquire(name: str) -> uuid.UUID:
    """Hold the worker name exclusively. A predecessor is dead when its heartbeat is stale,
    or — on this host — when its process no longer exists (then we take over at once)."""
    host = socket.gethostname()
    boot_id = uuid.uuid4()
    stale_after = timedelta(seconds=settings.AGENTOPS["WORKER_STALE_AFTER"])
    now = db_now()
    try:
        with transaction.atomic():
            current = Worker.objects.select_for_update().filter(name=name).first()
            if current is not None and current.health != Worker.Health.STOPPED:
                fresh = current.heartbeat_at > now - stale_after
                same_host = current.host == host
                if fresh and (
                    not same_host or (current.pid != os.getpid() and _pid_alive(current.pid))
                ):
                    raise IdentityHeld(
                        f"worker name {name!r} is held by pid {current.pid} on {current.host}; "
                        "choose another --name"
                    )
            Worker.objects.update_or_create(
                name=name,
                defaults={
                    "host": host,
                    "pid": os.getpid(),
                    "boot_id": boot_id,
                    "started_at": now,
                    "heartbeat_at": now,
                    "last_task_at": None,
                    "health": Worker.Health.STARTING,
                    "detail": "",
                    # what this release's code drives: runs it cannot serve are handed to
                    # a worker that can (runs/engine/serving.py)
                    "serves": registry.serves(),
                },
            )
    except IntegrityError:
        raise IdentityHeld(f"worker name {name!r} was taken concurrently") from None
    return boot_id


def take_over_predecessor(name: str) -> int:
    """Our predecessor under this name is dead: its leases are void now, not at expiry, and
    its runs are woken at once, as the sweeper wakes an orphan (``enqueued_at`` stamped, one
    wake-up each, sent on commit). runworker does this before its cluster starts, so the
    cluster's first poll finds them; its first sweep then runs beside the cluster."""
    with transaction.atomic():
        # locked: a run whose lease another worker took since (it had expired) is not ours
        run_ids = list(
            Run.objects.select_for_update()
            .filter(lease_owner=name, status__in=Run.RUNNABLE)
            .values_list("id", flat=True)
        )
        Run.objects.filter(id__in=run_ids).update(lease_expires_at=None, enqueued_at=Now())
        for run_id in run_ids:
            enqueue_on_commit(run_id)
    return len(run_ids)


def heartbeat(name: str, boot_id: uuid.UUID) -> bool:
    """False when another process has taken this identity: we must stop."""
    return Worker.objects.filter(name=name, boot_id=boot_id).update(heartbeat_at=Now()) == 1


def check_liveness(
    name: str, boot_id: uuid.UUID, *, pending_tasks: int, started: float, now: float
) -> str:
    """A cluster that ran no task for FROZEN_AFTER while tasks wait is frozen (django-q2
    issue #23: an idle worker's death can stop the whole cluster silently)."""
    frozen_after = settings.AGENTOPS["FROZEN_AFTER"]
    worker = Worker.objects.filter(name=name, boot_id=boot_id).first()
    if worker is None:
        return "gone"
    reference = worker.last_task_at or worker.started_at
    idle = (db_now() - reference).total_seconds()
    if pending_tasks > 0 and idle > frozen_after and now - started > frozen_after:
        health = Worker.Health.FROZEN
        detail = f"no task ran for {idle:.0f}s while {pending_tasks} wait: the cluster looks frozen"
    else:
        health, detail = Worker.Health.HEALTHY, ""
    if health != worker.health:
        if health == Worker.Health.FROZEN:
            log.error("WORKER %s IS FROZEN: %s", name, detail)
        else:
            log.info("worker %s is healthy", name)
        Worker.objects.filter(name=name, boot_id=boot_id).update(health=health, detail=detail)
    return health


def identity_release(name: str, boot_id: uuid.UUID) -> None:
    released = Worker.objects.filter(name=name, boot_id=boot_id).update(
        health=Worker.Health.STOPPED, heartbeat_at=Now()
    )
    if released:
        # anything we still held is free for others at once. Only while the name is still
        # ours: if another process took it over, these leases are that process's now.
        Run.objects.filter(lease_owner=name, status__in=Run.RUNNABLE).update(lease_expires_at=None)
