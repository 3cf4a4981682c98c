"""Wake-up signals. django-q2 only says "look at this run"; the run table decides."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django_q.tasks import async_task

log = logging.getLogger(__name__)

ADVANCE_TASK = "runs.tasks.advance_run"


def enqueue_run(run_id: Any) -> None:
    try:
        async_task(ADVANCE_TASK, str(run_id), task_name=f"advance-{run_id}"[:100])
    except Exception:
        # A lost wake-up is not lost work: the sweeper re-enqueues unclaimed runnable runs.
        log.exception("could not enqueue run %s; the sweeper will pick it up", run_id)


def enqueue_on_commit(run_id: Any) -> None:
    transaction.on_commit(lambda: enqueue_run(run_id))
