"""``python manage.py prune --terminal-older-than 90d [--dry-run] [--archive DIR]``

Retention for finished runs: empties the bulky data of terminal runs that ended longer ago
than the given age — step input/output, tool-call arguments, receipt results, run state —
after optionally archiving it as JSON lines. Every event and digest is kept (the chains still
verify) and each run gets a ``run.pruned`` event. Defaults come from the settings
``AGENTOPS_PRUNE_TERMINAL_AFTER`` and ``AGENTOPS_PRUNE_ARCHIVE_DIR``; see docs/audit.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import OperationalError
from django.utils import timezone

from runs.actors import Actor
from runs.audit.retention import prune_candidates, prune_counts, run_archive_record, run_prune
from runs.management.options import archive_directory

UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
# shorter than this is almost certainly a typo (``90m`` for ``90d``), not a retention policy
MINIMUM_AGE = timedelta(days=1)
BATCH = 100


def parse_age(value: str) -> timedelta:
    match = re.fullmatch(r"\s*(\d+)\s*([mhdw])\s*", value or "")
    if not match:
        raise CommandError(
            f"--terminal-older-than {value!r} is not an age: use a number and a unit "
            "(m, h, d or w), e.g. 90d"
        )
    age = timedelta(**{UNITS[match.group(2)]: int(match.group(1))})
    if age < MINIMUM_AGE:
        raise CommandError("--terminal-older-than must be at least 1d")
    return age


class Command(BaseCommand):
    help = "Empty the bulky data of old terminal runs (optionally archived); events are kept."

    def add_arguments(self, parser):
        parser.add_argument(
            "--terminal-older-than",
            default=None,
            metavar="AGE",
            help="prune runs that ended longer ago than this (e.g. 90d, 12w); "
            "default: AGENTOPS_PRUNE_TERMINAL_AFTER",
        )
        parser.add_argument("--dry-run", action="store_true", help="only report what would go")
        parser.add_argument(
            "--archive",
            default=None,
            metavar="DIR",
            help="first write the data to a JSONL file in DIR; default: AGENTOPS_PRUNE_ARCHIVE_DIR",
        )
        parser.add_argument("--limit", type=int, default=None, help="prune at most this many runs")

    def handle(self, *args, **options):
        age_text = options["terminal_older_than"] or settings.AGENTOPS.get(
            "PRUNE_TERMINAL_AFTER", "90d"
        )
        age = parse_age(age_text)
        archive_dir = options["archive"]
        if archive_dir is None:
            archive_dir = settings.AGENTOPS.get("PRUNE_ARCHIVE_DIR", "")
        if options["limit"] is not None and options["limit"] < 1:
            raise CommandError("--limit must be at least 1")
        try:
            self._prune(age, age_text.strip(), archive_dir, options)
        except OperationalError as exc:
            raise CommandError(
                f"cannot reach the database: {str(exc).strip().splitlines()[0]}"
            ) from None

    def _prune(self, age: timedelta, age_text: str, archive_dir: str, options) -> None:
        candidates = prune_candidates(age).order_by("created_at", "id")
        run_ids = list(candidates.values_list("id", flat=True)[: options["limit"]])
        if options["dry_run"]:
            counts = prune_counts(run_ids)
            self.stdout.write(
                f"dry run: would prune {counts['runs']} run(s) that ended more than {age_text} "
                f"ago ({counts['steps']} steps, {counts['tool_calls']} tool calls, "
                f"{counts['receipts']} receipts); nothing written"
            )
            return
        if not run_ids:
            self.stdout.write(f"nothing to prune: no terminal run ended more than {age_text} ago")
            return
        archive_path = self._open_archive(archive_dir) if archive_dir else None
        actor = Actor.system("cli")
        totals = {"runs": 0, "steps": 0, "tool_calls": 0, "receipts": 0}
        archive = None
        try:
            if archive_path is not None:
                archive = archive_path.open("x", encoding="utf-8")
            for start in range(0, len(run_ids), BATCH):
                batch = run_ids[start : start + BATCH]
                digests: dict[object, str] = {}
                if archive is not None:
                    # archived and on disk (fsync) before anything is emptied: a crash between
                    # the two leaves data in both places, never in neither
                    for run_id in batch:
                        line = json.dumps(run_archive_record(run_id), sort_keys=True) + "\n"
                        archive.write(line)
                        digests[run_id] = hashlib.sha256(line.encode()).hexdigest()
                    archive.flush()
                    os.fsync(archive.fileno())
                for run_id in batch:
                    counts = run_prune(
                        run_id=run_id,
                        actor=actor,
                        older_than=age_text,
                        archive=archive_path.name if archive_path else "",
                        archive_digest=digests.get(run_id, ""),
                    )
                    if counts is None:
                        continue
                    totals["runs"] += 1
                    for key, value in counts.items():
                        totals[key] += value
        finally:
            if archive is not None:
                archive.close()
        where = f"; archived to {archive_path}" if archive_path else ""
        self.stdout.write(
            f"pruned {totals['runs']} run(s) that ended more than {age_text} ago "
            f"({totals['steps']} steps, {totals['tool_calls']} tool calls, "
            f"{totals['receipts']} receipts emptied; events kept){where}"
        )

    def _open_archive(self, archive_dir: str) -> Path:
        directory = archive_directory(archive_dir)
        stamp = timezone.now().strftime("%Y%m%dT%H%M%S%fZ")
        return directory / f"agentops-prune-{stamp}.jsonl"
