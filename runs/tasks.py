"""django-q2 entry points: they take ids and call the engine."""

from __future__ import annotations

import os
import socket

from django.db.models.functions import Now

from runs import engine
from runs.models import Worker


def current_worker_name() -> str:
    return os.environ.get("AGENTOPS_WORKER_NAME") or f"{socket.gethostname()}:{os.getpid()}"


def advance_run(run_id: str) -> str:
    name = current_worker_name()
    # proof of life for the liveness check: this worker's cluster runs tasks
    Worker.objects.filter(name=name).update(last_task_at=Now())
    try:
        return engine.advance(run_id, worker=name)
    finally:
        # and again at the end: a long slice is not idleness
        Worker.objects.filter(name=name).update(last_task_at=Now())


def canary(origin: str) -> None:
    """Enqueued by every worker's sweeper; whoever runs it shows its cluster is alive."""
    Worker.objects.filter(name=current_worker_name()).update(last_task_at=Now())
