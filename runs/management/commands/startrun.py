"""``python manage.py startrun AGENT [--goal G] [--input JSON] [--max-steps N] [--dry-run]``"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import OperationalError

from runs import jsonlimits
from runs.actors import Actor
from runs.registry import UnknownAgent
from runs.services import InvalidInput, run_create


class Command(BaseCommand):
    help = "Start a run of a registered agent; prints the run id."

    def add_arguments(self, parser):
        parser.add_argument("agent")
        parser.add_argument("--goal", default="")
        parser.add_argument("--input", default="{}", help="the run's input as a JSON object")
        parser.add_argument("--max-steps", type=int, default=None)
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="tools with side effects only say what they would do (docs/agents.md)",
        )

    def handle(self, *args, **options):
        try:
            data = jsonlimits.loads(options["input"])
        except jsonlimits.JsonRejected as exc:
            raise CommandError(f"--input: {exc.detail}") from None
        except ValueError as exc:
            raise CommandError(f"--input is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise CommandError("--input must be a JSON object")
        try:
            run = run_create(
                agent_name=options["agent"],
                goal=options["goal"],
                input=data,
                max_steps=options["max_steps"],
                dry_run=options["dry_run"],
                actor=Actor.system("cli"),
            )
        except (UnknownAgent, InvalidInput) as exc:
            raise CommandError(str(exc)) from None
        except OperationalError as exc:
            raise CommandError(
                f"cannot reach the database: {str(exc).strip().splitlines()[0]}"
            ) from None
        self.stdout.write(str(run.id))
