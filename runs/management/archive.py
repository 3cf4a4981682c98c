"""What the commands that archive share (``prune --archive-dir``, ``retention --archive``): the
directory they write to, made if need be, and refused up front if it cannot be written — before
anything is pruned or dropped, not halfway through."""

from __future__ import annotations

import os
from pathlib import Path

from django.core.management.base import CommandError


def archive_directory(value: str) -> Path:
    directory = Path(value)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommandError(f"cannot create archive directory {directory}: {exc.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise CommandError(f"archive directory {directory} is not writable")
    return directory
