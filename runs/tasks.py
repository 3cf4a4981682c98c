"""django-q2 entry points: they take ids and call the engine."""

from __future__ import annotations

import os
import socket
import time

from django.conf import settings
from django.db.models.functions import Now

from runs import engine, flow, tracing
from runs.engine import loop
from runs.models import Worker


def current_worker_name() -> str:
    return os.environ.get("AGENTOPS_WORKER_NAME") or f"{socket.gethostname()}:{os.getpid()}"


# when this task process last wrote its worker's ``last_task_at`` (monotonic clock)
_stamped_at: float | None = None


def _stamp_last_task(name: str, *, force: bool = False) -> None:
    """Proof of life for the liveness check: this worker's cluster runs tasks. Written at
    most every few seconds per task process (FROZEN_AFTER is far longer): a task of a short
    run otherwise costs one more commit than its steps (docs/benchmarks.md)."""
    global _stamped_at
    now = time.monotonic()
    every = min(5.0, settings.AGENTOPS["FROZEN_AFTER"] / 4)
    if force or _stamped_at is None or now - _stamped_at >= every:
        Worker.objects.filter(name=name).update(last_task_at=Now())
        _stamped_at = now


def advance_run(run_id: str) -> str:
    name = current_worker_name()
    # in the forked task process itself: an exporter's thread would not survive the fork
    tracing.configure_from_env_once()
    _stamp_last_task(name)
    started = time.monotonic()
    try:
        with flow.handing_over():
            outcome = engine.advance(run_id, worker=name)
            _advance_handed_over(name, started)
        return outcome
    finally:
        # and again at the end of a long slice: it was not idleness
        if time.monotonic() - started > 1.0:
            _stamp_last_task(name, force=True)


def _advance_handed_over(name: str, started: float) -> None:
    """Under a binding limit (issue 26) the run that freed a slot woke the next waiter; this
    process advances it at once (its queued task then finds it taken or done) instead of
    leaving the slot idle for a poll and a claim. Bounded by the slice's time from the
    task's start (each run's own slice is bounded too), and stops when the worker stops."""
    while time.monotonic() - started < settings.AGENTOPS["SLICE_SECONDS"] and not (
        loop._stop_requested()
    ):
        run_id = flow.take_handed_over()
        if run_id is None:
            return
        engine.advance(run_id, worker=name)


def canary(origin: str) -> None:
    """Enqueued by every worker's sweeper; whoever runs it shows its cluster is alive."""
    Worker.objects.filter(name=current_worker_name()).update(last_task_at=Now())
