"""On PostgreSQL, TRUNCATE of an append-only table is refused too (issue 17): row-level
UPDATE/DELETE triggers (migrations 0004 and 0006) do not fire for TRUNCATE, which emptied a
table in one statement. A statement-level BEFORE TRUNCATE trigger refuses it, also when it
arrives through ``TRUNCATE <parent> CASCADE``. The table's owner can still disable a trigger:
docs/operations.md runs the application as a role that owns nothing (``manage.py db_app_role``).
Nothing to do on SQLite (no TRUNCATE statement)."""

from django.db import migrations

APPEND_ONLY_TABLES = ["runs_runevent", "runs_auditentry"]


def _create(table):
    # agentops_append_only() (migration 0004) raises whatever TG_OP is, row or statement level
    return f"""
DROP TRIGGER IF EXISTS {table}_no_truncate ON {table};
CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table}
    FOR EACH STATEMENT EXECUTE FUNCTION agentops_append_only();
"""


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for table in APPEND_ONLY_TABLES:
            schema_editor.execute(_create(table), params=None)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for table in APPEND_ONLY_TABLES:
            schema_editor.execute(f"DROP TRIGGER IF EXISTS {table}_no_truncate ON {table};", params=None)


class Migration(migrations.Migration):
    dependencies = [("runs", "0017_agent_manifest_owner_question_groups")]

    operations = [migrations.RunPython(forwards, backwards)]
