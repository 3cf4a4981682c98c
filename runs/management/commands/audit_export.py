"""``python manage.py audit_export --since … [--until …] [--format csv|jsonl] [--run ID]``

Streams run events with ``since <= created_at < until`` to stdout (or ``--output FILE``) in
constant memory: keyset-paginated queries of ``--chunk-size`` rows, each written out before
the next is read. Dates are ISO 8601 (``2026-12-03``, ``2026-12-03T14:00``,
``2026-12-03T14:00:00+01:00``); a date or a time without an offset is in ``TIME_ZONE``.
Sensitive arguments are masked at write time, and the run's sensitive tool output is masked
as it is written out (runs.masking): an export holds neither. A masked payload no longer
matches its ``payload_digest``; the chain (``prev_hash`` / ``hash``) is over the digests.
"""

from __future__ import annotations

from datetime import datetime, time

from django.core.management.base import BaseCommand, CommandError
from django.db import OperationalError
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from runs.audit.export import (
    EVENT_COLUMNS,
    EXPORT_CHUNK_SIZE,
    csv_lines,
    event_row,
    events_for_export,
    jsonl_lines,
    keyset_iterate,
)
from runs.management.options import existing_run_id
from runs.masking import masked_rows


def parse_moment(option: str, value: str) -> datetime:
    """An ISO date or datetime, aware. A bare date is its midnight in TIME_ZONE."""
    text = value.strip()
    try:
        moment = parse_datetime(text)
        if moment is None:
            day = parse_date(text)
            if day is None:
                raise ValueError
            moment = datetime.combine(day, time.min)
    except ValueError:
        raise CommandError(
            f"{option} {value!r} is not a date or time (use e.g. 2026-12-03 or 2026-12-03T14:00)"
        ) from None
    if timezone.is_naive(moment):
        moment = timezone.make_aware(moment)
    return moment


class Command(BaseCommand):
    help = "Stream the run events of a time range as CSV or JSON lines (constant memory)."

    def add_arguments(self, parser):
        parser.add_argument("--since", required=True, help="start (inclusive), ISO date or time")
        parser.add_argument("--until", default=None, help="end (exclusive); default: now")
        parser.add_argument("--format", default="csv", help="csv (default) or jsonl")
        parser.add_argument("--run", default=None, help="only this run's events")
        parser.add_argument(
            "--type",
            action="append",
            default=[],
            help="only events of this type (repeatable), e.g. approval.decided",
        )
        parser.add_argument("--output", default=None, help="write to this file instead of stdout")
        parser.add_argument("--chunk-size", type=int, default=EXPORT_CHUNK_SIZE)

    def handle(self, *args, **options):
        fmt = options["format"].lower()
        if fmt not in ("csv", "jsonl"):
            raise CommandError(f"--format must be csv or jsonl, not {options['format']!r}")
        since = parse_moment("--since", options["since"])
        until = parse_moment("--until", options["until"]) if options["until"] else None
        if until is not None and until <= since:
            raise CommandError("--until must be after --since")
        if options["chunk_size"] < 1:
            raise CommandError("--chunk-size must be at least 1")
        run_id = None
        if options["run"]:
            run_id = existing_run_id(options["run"])
        events = events_for_export(since=since, until=until, run_id=run_id, types=options["type"])
        events = masked_rows(
            keyset_iterate(events, chunk_size=options["chunk_size"]),
            run_id=lambda event: event["run_id"],
            fields=("payload",),
            chunk_size=options["chunk_size"],
        )
        rows = (event_row(event) for event in events)
        self._csv = fmt == "csv"
        lines = csv_lines(EVENT_COLUMNS, rows) if self._csv else jsonl_lines(rows)
        try:
            if options["output"]:
                try:
                    out = open(options["output"], "w", encoding="utf-8", newline="")  # noqa: SIM115
                except OSError as exc:
                    raise CommandError(
                        f"cannot write {options['output']}: {exc.strerror}"
                    ) from None
                with out:
                    count = self._write(lines, out)
                self.stderr.write(f"{count} event(s) written to {options['output']}")
            else:
                self._write(lines, self.stdout)
        except OperationalError as exc:
            raise CommandError(
                f"cannot reach the database: {str(exc).strip().splitlines()[0]}"
            ) from None

    def _write(self, lines, out) -> int:
        """Write every line; return the number of events (lines after a CSV header)."""
        count = 0
        for line in lines:
            if out is self.stdout:
                out.write(line, ending="")
            else:
                out.write(line)
            count += 1
        out.flush()
        return count - 1 if self._csv else count
