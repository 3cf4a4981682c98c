"""``python manage.py db_app_role ROLE [--apply]``: the least-privileged database role.

Prints the SQL that creates ROLE (if it does not exist) with no ownership and only the DML the
application needs — SELECT and INSERT on the append-only tables (run events, audit entries),
SELECT, INSERT, UPDATE and DELETE on the others, no TRUNCATE anywhere — or, with ``--apply``,
runs it. Run it as the tables' owner after every ``migrate`` (new tables get no grant until
then); set the role's password yourself (``ALTER ROLE … PASSWORD``, psql's ``\\password``).
docs/operations.md, "Running as a least-privileged database role".
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction

from runs.dbrole import current_app_role_sql, role_owns_nothing


class Command(BaseCommand):
    help = "Print (or --apply) the SQL for a database role that owns nothing and has only the DML it needs."

    def add_arguments(self, parser):
        parser.add_argument(
            "role", help="the role the application will connect as, e.g. agentops_app"
        )
        parser.add_argument(
            "--apply", action="store_true", help="run the statements instead of printing them"
        )

    def handle(self, *args, **options):
        if connection.vendor != "postgresql":
            raise CommandError(
                "db_app_role is for PostgreSQL; SQLite has no roles (protect its file instead)"
            )
        role = options["role"]
        if not role or len(role) > 63 or "\x00" in role:
            raise CommandError("the role name must be 1 to 63 characters")
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_user")
            (current,) = cursor.fetchone()
        if role == current:
            raise CommandError(
                f"{role!r} is the role this command connects as (the owner): name another role"
            )
        statements = current_app_role_sql(role)
        if not options["apply"]:
            for statement in statements:
                self.stdout.write(statement + ";")
            return
        with transaction.atomic(), connection.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)
        if not role_owns_nothing(role):
            raise CommandError(
                f"role {role!r} owns tables in this database: it could disable their triggers. "
                f"Transfer them (REASSIGN OWNED BY {role} TO <owner>) and run this again."
            )
        self.stdout.write(f"role {role}: {len(statements)} statements applied")
