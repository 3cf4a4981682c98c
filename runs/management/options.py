"""Options more than one command reads, each read one way and refused (``CommandError``) before
the command changes or writes anything."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from django.core.management.base import CommandError

from runs.models import Run


def archive_directory(value: str) -> Path:
    """``prune --archive-dir``, ``retention --archive``: the directory archives go to, made if
    need be and writable — refused up front, not halfway through a prune or a drop."""
    directory = Path(value)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommandError(f"cannot create archive directory {directory}: {exc.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise CommandError(f"archive directory {directory} is not writable")
    return directory


def existing_run_id(value: str) -> uuid.UUID:
    """``audit_export --run``, ``audit_verify --run``: the id of a run that exists."""
    try:
        run_id = uuid.UUID(value)
    except ValueError:
        raise CommandError(f"--run {value!r} is not a run id") from None
    if not Run.objects.filter(id=run_id).exists():
        raise CommandError(f"run {run_id} does not exist")
    return run_id
