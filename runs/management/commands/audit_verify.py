"""``python manage.py audit_verify [--full] [--run ID] [--audit-head HASH] [--expect-head FILE]
[--write-head FILE]`` or ``audit_verify --export HEADS_FILE``: walk the hash chains.

Without ``--run``: every run's event chain, then the audit entry chain; with ``--run``: that
run's chain only. Incremental unless ``--full``: a run's events already verified by an
earlier check are not read again, only those after them (``runs.audit.run_chains``: what that
does not cover); ``--full`` reads every stored event. Exits 1 naming the first broken link.
Prints the audit log's head hash: keep it somewhere else (a ticket, a log shipper) and pass
it as ``--audit-head`` later to prove the log was not cut short or rewritten since.
``--write-head FILE`` records the newest entry and event and their counts as JSON after a
clean check; ``--expect-head FILE`` fails unless all of them are still there — an emptied or
rewound table verifies as an intact chain otherwise. ``--export`` checks an export of
``retention``: the part of each run's chain it holds, from the run's start to the head the
database records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import OperationalError

from runs.audit.entries import verify_entries
from runs.audit.heads import chain_head, head_problems
from runs.audit.retention import verify_export
from runs.audit.run_chains import verified_head_gone, verify_all
from runs.errors import DomainError, InvalidInput
from runs.management.options import existing_run_id
from runs.models import Run


class Command(BaseCommand):
    help = "Verify the tamper-evident event and audit chains; exit 1 naming the first broken link."

    def add_arguments(self, parser):
        parser.add_argument("--run", default=None, help="verify only this run id")
        parser.add_argument(
            "--full",
            action="store_true",
            help="re-verify every stored event, not only those after the last verified point "
            "(finds an event rewritten after it was verified)",
        )
        parser.add_argument(
            "--export",
            default=None,
            metavar="HEADS_FILE",
            help="check an export written by retention (its .heads.json, the events file "
            "beside it) against itself and the database, then stop",
        )
        parser.add_argument(
            "--audit-head",
            default=None,
            metavar="HASH",
            help="an audit head hash printed by an earlier run: fail unless it is still in the chain",
        )
        parser.add_argument(
            "--expect-head",
            default=None,
            metavar="FILE",
            help="a head written by --write-head: fail unless every entry and event it "
            "counted is still there (detects an emptied or rewound table)",
        )
        parser.add_argument(
            "--write-head",
            default=None,
            metavar="FILE",
            help="after a clean check, write the current head to FILE (keep it outside the "
            "database's reach; may be the --expect-head file)",
        )

    def handle(self, *args, **options):
        if options["export"]:
            others = ("run", "full", "audit_head", "expect_head", "write_head")
            if any(options[name] for name in others):
                raise CommandError("--export checks an export alone: give it no other option")
            try:
                counts = verify_export(Path(options["export"]))
            except InvalidInput as exc:
                raise CommandError(f"--export: {exc}") from None
            except DomainError as exc:
                raise CommandError(f"broken export: {exc}") from None
            self.stdout.write(
                f"ok: {counts['events']} exported events of {counts['runs']} run(s) link from "
                "each run's start to the head the database records"
            )
            return
        run_ids = None
        if options["run"]:
            run_id = existing_run_id(options["run"])
            run_ids = [run_id]
        expected_head = options["audit_head"]
        if expected_head is not None:
            expected_head = expected_head.strip().lower()
            if len(expected_head) != 64 or any(c not in "0123456789abcdef" for c in expected_head):
                raise CommandError("--audit-head must be a 64-character hex hash")
            if run_ids is not None:
                raise CommandError("--audit-head checks the audit log; it cannot go with --run")
        if run_ids is not None and (options["expect_head"] or options["write_head"]):
            raise CommandError("--expect-head and --write-head cover everything; not with --run")
        pinned = None
        if options["expect_head"]:
            try:
                pinned = json.loads(Path(options["expect_head"]).read_text())
            except (OSError, ValueError) as exc:
                raise CommandError(
                    f"--expect-head: cannot read {options['expect_head']}: {exc}"
                ) from None
        checked = 0
        try:
            # before the walk: everything the written head counts is then verified below
            head = chain_head() if options["write_head"] else None
            full = options["full"]
            for _run, broken in verify_all(run_ids, full=full, record=True):
                if broken is not None:
                    raise CommandError(f"broken chain: {broken}")
                checked += 1
            if full:
                self.stdout.write(f"ok: {checked} run chain(s) intact (full)")
            else:
                broken = verified_head_gone(run_ids)
                if broken is not None:
                    raise CommandError(f"broken chain: {broken}")
                runs = Run.objects.all() if run_ids is None else Run.objects.filter(id__in=run_ids)
                unchanged = runs.count() - checked
                self.stdout.write(
                    f"ok: {checked} run chain(s) intact; {unchanged} unchanged since they were "
                    "verified (not read again: --full reads everything)"
                )
            if run_ids is not None:
                return
            result = verify_entries(expected_head=expected_head)
            problems = head_problems(pinned) if pinned is not None else []
        except ValueError as exc:
            raise CommandError(f"--expect-head: {exc}") from None
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
        if problems:
            raise CommandError("head does not match: " + "; ".join(problems))
        self.stdout.write(
            f"ok: {result.checked} audit entr{'y' if result.checked == 1 else 'ies'} intact; "
            f"audit head {result.head}"
            + (f" (entry {result.head_id})" if result.head_id is not None else "")
        )
        if pinned is not None:
            self.stdout.write(
                f"ok: every entry and event of the head {options['expect_head']} is there"
            )
        elif not options["write_head"]:
            self.stdout.write(
                "note: no --expect-head given: an emptied or rewound table looks like a new one"
            )
        if options["write_head"]:
            _write_atomically(Path(options["write_head"]), json.dumps(head, indent=2) + "\n")
            self.stdout.write(f"head written to {options['write_head']}")


def _write_atomically(path: Path, text: str) -> None:
    # a crash while writing must not leave a truncated head that fails every later check
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
