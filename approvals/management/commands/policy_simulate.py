"""``python manage.py policy_simulate VERSION [--days N] [--all] [--json]`` or
``python manage.py policy_simulate --tool NAME --rules FILE [--time-zone TZ] [--agent A]
[--group G]``: replay the last N days of a tool's calls against an approval policy version (a
draft, usually) or against rules not yet drafted, and list the calls whose outcome would
change — newly needing approval, denied, no longer needing approval, needing other approvers
— compared with the policy in force now (docs/approvals.md, "Simulating a change").

Reads only (a draft's simulation counts are kept on it for the publish page). Exits 0 whatever
it finds; ``--fail-on-change`` exits 3 when any call would change, for a CI check of a policy
kept in a repository.
"""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from approvals.models import ApprovalPolicyVersion
from approvals.policy_services import (
    SIMULATE_MAX_DAYS,
    Change,
    PolicyInvalid,
    policy_rules_simulate,
    policy_simulate,
)
from runs.actors import Actor
from runs.services import InvalidInput


class Command(BaseCommand):
    help = "Replay the last N days of a tool's calls against an approval policy version."

    def add_arguments(self, parser):
        parser.add_argument("version", nargs="?", type=int, help="the policy version's id")
        parser.add_argument("--days", type=int, default=7, help="how far back (default 7)")
        parser.add_argument("--tool", default="", help="with --rules: the tool")
        parser.add_argument("--rules", default="", metavar="FILE", help="rules as JSON")
        parser.add_argument("--time-zone", default="UTC")
        parser.add_argument("--agent", default="", help="with --rules: an agent's scope")
        parser.add_argument("--group", default="", help="with --rules: a principal group")
        parser.add_argument("--all", action="store_true", help="list unchanged calls too")
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        parser.add_argument(
            "--fail-on-change", action="store_true", help="exit 3 if any call would change"
        )

    def handle(self, *args, **options):
        days = options["days"]
        if not 1 <= days <= SIMULATE_MAX_DAYS:
            raise CommandError(f"--days must be from 1 to {SIMULATE_MAX_DAYS}")
        actor = Actor.system("cli")
        try:
            if options["rules"]:
                if options["version"] or not options["tool"]:
                    raise CommandError("--rules needs --tool and no version")
                try:
                    rules = json.loads(Path(options["rules"]).read_text())
                except (OSError, ValueError) as exc:
                    raise CommandError(f"cannot read {options['rules']}: {exc}") from None
                simulation = policy_rules_simulate(
                    actor=actor,
                    tool_name=options["tool"],
                    rules=rules,
                    time_zone=options["time_zone"],
                    agent_name=options["agent"],
                    principal_group=options["group"],
                    days=days,
                )
                label = f"these rules for {options['tool']}"
            else:
                if not options["version"]:
                    raise CommandError("name a policy version (its id) or give --tool and --rules")
                try:
                    version = ApprovalPolicyVersion.objects.select_related("policy").get(
                        id=options["version"]
                    )
                except ApprovalPolicyVersion.DoesNotExist:
                    raise CommandError(f"no policy version {options['version']}") from None
                simulation = policy_simulate(actor=actor, version_id=version.id, days=days)
                label = f"{version.policy} v{version.number} ({version.status})"
        except PolicyInvalid as exc:
            lines = [f"  {where}: {msg}" for where, msgs in exc.fields.items() for msg in msgs]
            raise CommandError("the rules are not valid:\n" + "\n".join(lines)) from None
        except InvalidInput as exc:
            raise CommandError(str(exc)) from None
        if options["json"]:
            data = simulation.as_dict()
            if options["all"]:
                data["calls"] = [c.__dict__ for c in simulation.calls]
            self.stdout.write(json.dumps(data, indent=2, default=str))
            if simulation.truncated:
                self.stderr.write(f"CAPPED: {simulation.truncation_note}")
        else:
            self.stdout.write(
                f"{label}: {len(simulation.calls)} calls of {simulation.tool_name} in the last "
                f"{days} days, compared with {simulation.compared_with} (the policy in force "
                "today; each call with the one that reaches it)"
            )
            if simulation.truncated:
                self.stdout.write(f"CAPPED: {simulation.truncation_note}")
            for key, label_text in Change.LABELS.items():
                self.stdout.write(f"  {simulation.counts[key]:>6}  {label_text}")
            shown = simulation.calls if options["all"] else simulation.changed
            for call in shown:
                marker = " (reconstructed)" if call.reconstructed else ""
                marker += " (dry run)" if call.dry_run else ""
                self.stdout.write(
                    f"{call.decided_at[:19]}  {call.idempotency_key}  "
                    f"{json.dumps(call.arguments_masked, default=str)}  "
                    f"{call.before} [{call.before_policy}] -> {call.after}{marker}"
                )
        if options["fail_on_change"] and simulation.changed:
            raise SystemExit(3)
