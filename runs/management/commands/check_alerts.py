"""Look for alert causes and email operators once per cause (runs.alerts).

Every worker's sweeper already does this. Run this command from cron or a systemd timer (or
with ``--every``) to be told when *no* worker is running: then no sweeper is either.
"""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand, CommandParser

from runs import alerts


class Command(BaseCommand):
    help = (
        "Email operators about runs needing attention and stopped or missing workers (once each)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--every",
            type=float,
            default=0.0,
            metavar="SECONDS",
            help="keep checking at this interval until interrupted (default: one pass)",
        )

    def handle(self, *args, every: float = 0.0, **options) -> None:
        while True:
            sent = alerts.alerts_check()
            if options["verbosity"] >= 1 and (sent or not every):
                self.stdout.write(f"{sent} alert(s) sent")
            if every <= 0:
                return
            time.sleep(every)
