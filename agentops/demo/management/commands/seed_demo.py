"""``python manage.py seed_demo``: the demo sign-in and a few demo runs (no processes)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from agentops.demo.seed import demo_logins_ensure, demo_runs_seed


class Command(BaseCommand):
    help = "Create the demo sign-in and seed demo runs (only when no runs exist yet)."

    def add_arguments(self, parser):
        parser.add_argument(
            "--force", action="store_true", help="seed the demo runs even if runs exist"
        )

    def handle(self, *args, **options):
        try:
            logins = demo_logins_ensure()
            runs = demo_runs_seed(force=options["force"])
        except (DatabaseError, LookupError) as exc:
            raise CommandError(
                f"cannot seed the database: {str(exc).strip().splitlines()[0]} "
                "(did you run `python manage.py migrate`?)"
            ) from None
        for login in logins:
            if login.password:
                self.stdout.write(
                    f"created the sign-in {login.username!r} with password {login.password} "
                    "(shown only now)"
                )
        if runs:
            for run in runs:
                self.stdout.write(f"created run {str(run.id)[:8]} {run.agent_name}: {run.goal}")
        else:
            self.stdout.write("runs exist already: no demo runs created (use --force to add them)")
