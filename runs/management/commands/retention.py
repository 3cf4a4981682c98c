"""``python manage.py retention --before YYYY-MM [--archive DIR] [--drop] [--create-ahead N]``

Retention of events by whole months (docs/operations.md, "Retention"): the runs created in a
month (UTC) before ``--before`` are archived when every one of them is terminal and pruned —
their chains verified, their events exported as JSON lines to ``DIR`` with a heads file (each
run's last seq and hash), synced, then recorded (``ArchivedChain``, an ``events.archived``
audit entry). ``--drop`` detaches and drops the events' partition of months wholly archived
(PostgreSQL, connected as the tables' owner); the run rows and their heads stay, so
``audit_verify`` still checks every chain that remains. Without ``--archive`` or ``--drop`` it only reports each month's state.

``--create-ahead N`` (PostgreSQL, as the owner; monthly from cron) creates the events'
partitions of this month and the next N, and of any month whose events landed in the
``DEFAULT`` partition (moving them into their own); ``--before`` is then optional.
"""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import OperationalError
from django.utils import timezone

from runs.actors import Actor
from runs.audit import partitions
from runs.audit.retention import MonthState, archive_month, drop_month, month_states, parse_month
from runs.errors import DomainError
from runs.management.options import archive_directory


class Command(BaseCommand):
    help = "Archive (export with chain heads) and drop the events of whole, finished months."

    def add_arguments(self, parser):
        parser.add_argument(
            "--before",
            metavar="YYYY-MM",
            help="only months before this one (by their runs' creation, UTC); at most the "
            "current month",
        )
        parser.add_argument(
            "--archive",
            default=None,
            metavar="DIR",
            help="verify and export every month that can go to DIR, and record it as archived",
        )
        parser.add_argument(
            "--drop",
            action="store_true",
            help="detach and drop the events' partitions of wholly archived months "
            "(PostgreSQL, as the owner)",
        )
        parser.add_argument(
            "--create-ahead",
            type=int,
            default=None,
            metavar="N",
            help="create the events' partitions of this month and the next N months "
            "(PostgreSQL, as the owner; run monthly)",
        )

    def handle(self, *args, **options):
        if options["create_ahead"] is not None:
            self._create_ahead(options["create_ahead"])
            if options["before"] is None:
                return
        elif options["before"] is None:
            raise CommandError("--before YYYY-MM is required (unless --create-ahead N)")
        try:
            before = parse_month(options["before"])
        except DomainError as exc:
            raise CommandError(f"--before: {exc}") from None
        now = timezone.now()
        if (before.year, before.month) > (now.year, now.month):
            raise CommandError(
                f"--before {options['before']}: runs of the current month are still being "
                "created; at most the current month"
            )
        directory = archive_directory(options["archive"]) if options["archive"] else None
        actor = Actor.system("cli")
        try:
            for state in month_states(before):
                self._month(state, directory, options["drop"], actor)
        except DomainError as exc:
            raise CommandError(str(exc)) from None
        except OperationalError as exc:
            raise CommandError(
                f"cannot reach the database: {str(exc).strip().splitlines()[0]}"
            ) from None

    def _create_ahead(self, months: int) -> None:
        if months < 0:
            raise CommandError("--create-ahead: a number of months, 0 or more")
        try:
            created = partitions.create_ahead(months)
        except DomainError as exc:
            raise CommandError(str(exc)) from None
        for name in created:
            self.stdout.write(f"created partition {name}")
        if not created:
            self.stdout.write(f"partitions in place for this month and the next {months}")

    def _month(self, state: MonthState, directory: Path | None, drop: bool, actor) -> None:
        line = (
            f"{state.label}: {state.runs} run(s), {state.archived} archived"
            f" ({state.to_drop} with events still stored)"
        )
        if state.to_archive and not state.archivable:
            line += (
                f"; cannot go yet: {state.not_terminal} not terminal, {state.not_pruned} not pruned"
            )
        self.stdout.write(line)
        to_drop = state.to_drop
        if directory is not None and state.archivable:
            summary = archive_month(state.month, directory, actor=actor)
            self.stdout.write(
                f"{state.label}: archived {summary['runs']} run(s), {summary['events']} events "
                f"to {directory / summary['events_file']} (heads: {summary['export']}, "
                f"sha256 {summary['export_sha256']})"
            )
            to_drop += summary["runs"]
            archivable_left = 0
        else:
            archivable_left = state.to_archive
        if drop and to_drop:
            if archivable_left:
                self.stdout.write(
                    f"{state.label}: not dropped: {archivable_left} run(s) not archived yet"
                )
                return
            summary = drop_month(state.month, actor=actor)
            self.stdout.write(
                f"{state.label}: dropped {summary['events']} events of {summary['runs']} run(s)"
            )
