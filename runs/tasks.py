"""django-q2 entry points: they take ids and call the engine."""

from __future__ import annotations

import os
import socket
import time

from django.db.models.functions import Now

from runs import engine, tracing
from runs.models import Worker


def current_worker_name() -> str:
    return os.environ.get("AGENTOPS_WORKER_NAME") or f"{socket.gethostname()}:{os.getpid()}"


def advance_run(run_id: str) -> str:
    name = current_worker_name()
    # in the forked task process itself: an exporter's thread would not survive the fork
    tracing.configure_from_env_once()
    # proof of life for the liveness check: this worker's cluster runs tasks
    Worker.objects.filter(name=name).update(last_task_at=Now())
    started = time.monotonic()
    try:
        return engine.advance(run_id, worker=name)
    finally:
        # and again at the end of a long slice: it was not idleness. After a short one the
        # stamp above is still fresh (FROZEN_AFTER is far longer), and one write per task
        # is saved on the hot path (docs/benchmarks.md).
        if time.monotonic() - started > 1.0:
            Worker.objects.filter(name=name).update(last_task_at=Now())


def canary(origin: str) -> None:
    """Enqueued by every worker's sweeper; whoever runs it shows its cluster is alive."""
    Worker.objects.filter(name=current_worker_name()).update(last_task_at=Now())
