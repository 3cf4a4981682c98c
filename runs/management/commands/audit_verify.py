"""``python manage.py audit_verify [--run ID]``: walk the run event hash chains."""

from __future__ import annotations

import uuid

from django.core.management.base import BaseCommand, CommandError
from django.db import OperationalError

from runs.audit import verify_all
from runs.models import Run


class Command(BaseCommand):
    help = "Verify the tamper-evident event chains; exit 1 naming the first broken link."

    def add_arguments(self, parser):
        parser.add_argument("--run", default=None, help="verify only this run id")

    def handle(self, *args, **options):
        run_ids = None
        if options["run"]:
            try:
                run_id = uuid.UUID(options["run"])
            except ValueError:
                raise CommandError(f"--run {options['run']!r} is not a run id") from None
            if not Run.objects.filter(id=run_id).exists():
                raise CommandError(f"run {run_id} does not exist")
            run_ids = [run_id]
        checked = 0
        try:
            for _run, broken in verify_all(run_ids):
                if broken is not None:
                    raise CommandError(f"broken chain: {broken}")
                checked += 1
        except OperationalError as exc:
            raise CommandError(
                f"cannot reach the database: {str(exc).strip().splitlines()[0]}"
            ) from None
        self.stdout.write(f"ok: {checked} run chain(s) intact")
