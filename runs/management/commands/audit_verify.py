"""``python manage.py audit_verify [--run ID] [--audit-head HASH]``: walk the hash chains.

Without ``--run``: every run's event chain, then the audit entry chain; with ``--run``: that
run's chain only. Exits 1 naming the first broken link. Prints the audit log's head hash: keep
it somewhere else (a ticket, a log shipper) and pass it as ``--audit-head`` later to prove the
log was not cut short or rewritten since.
"""

from __future__ import annotations

import uuid

from django.core.management.base import BaseCommand, CommandError
from django.db import OperationalError

from runs.audit import verify_all, verify_entries
from runs.models import Run


class Command(BaseCommand):
    help = "Verify the tamper-evident event and audit chains; exit 1 naming the first broken link."

    def add_arguments(self, parser):
        parser.add_argument("--run", default=None, help="verify only this run id")
        parser.add_argument(
            "--audit-head",
            default=None,
            metavar="HASH",
            help="an audit head hash printed by an earlier run: fail unless it is still in the chain",
        )

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
        expected_head = options["audit_head"]
        if expected_head is not None:
            expected_head = expected_head.strip().lower()
            if len(expected_head) != 64 or any(c not in "0123456789abcdef" for c in expected_head):
                raise CommandError("--audit-head must be a 64-character hex hash")
            if run_ids is not None:
                raise CommandError("--audit-head checks the audit log; it cannot go with --run")
        checked = 0
        try:
            for _run, broken in verify_all(run_ids):
                if broken is not None:
                    raise CommandError(f"broken chain: {broken}")
                checked += 1
            self.stdout.write(f"ok: {checked} run chain(s) intact")
            if run_ids is not None:
                return
            result = verify_entries(expected_head=expected_head)
        except OperationalError as exc:
            raise CommandError(
                f"cannot reach the database: {str(exc).strip().splitlines()[0]}"
            ) from None
        if result.broken is not None:
            raise CommandError(f"broken chain: {result.broken}")
        if expected_head is not None and not result.head_found:
            raise CommandError(
                f"broken chain: audit head {expected_head} is no longer in the audit log "
                "(entries were removed from its end or rewritten)"
            )
        self.stdout.write(
            f"ok: {result.checked} audit entr{'y' if result.checked == 1 else 'ies'} intact; "
            f"audit head {result.head}"
            + (f" (entry {result.head_id})" if result.head_id is not None else "")
        )
