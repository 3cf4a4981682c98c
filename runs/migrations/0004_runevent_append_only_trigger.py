"""On PostgreSQL, a trigger rejects UPDATE and DELETE of run events at the database level,
so not even raw SQL can rewrite history unnoticed. Nothing to do on SQLite (the ORM guard
still applies there)."""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION agentops_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'table % is append-only: % refused', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS runs_runevent_append_only ON runs_runevent;
CREATE TRIGGER runs_runevent_append_only BEFORE UPDATE OR DELETE ON runs_runevent
    FOR EACH ROW EXECUTE FUNCTION agentops_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS runs_runevent_append_only ON runs_runevent;
"""


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE, params=None)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):
    dependencies = [("runs", "0003_resume_fork_recovery")]

    operations = [migrations.RunPython(forwards, backwards)]
