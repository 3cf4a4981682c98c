"""Issue 24 item 4 (a first slice) and incremental ``audit_verify``:

- ``VerifiedChain``: how far ``audit_verify`` has verified each run's chain;
- ``ArchivedChain``: the runs whose events ``retention`` exported, with the chain head the
  events still stored must start from;
- on PostgreSQL, the run events' append-only trigger lets through one kind of DELETE: of an
  event whose run was archived up to (at least) that event, in a transaction that asked for it
  (``SET LOCAL agentops.drop_archived = 'on'``), by a role holding DELETE on the table — the
  owner; the application's role holds only SELECT and INSERT (``runs.dbrole``). Every other
  UPDATE or DELETE is refused as before. Nothing to do on SQLite (no trigger there).
"""

import django.db.models.deletion
from django.db import migrations, models

CREATE = """
CREATE OR REPLACE FUNCTION agentops_events_append_only() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('agentops.drop_archived', true) = 'on'
       AND EXISTS (SELECT 1 FROM runs_archivedchain a
                   WHERE a.run_id = OLD.run_id AND OLD.seq <= a.seq) THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'table % is append-only: % refused', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS runs_runevent_append_only ON runs_runevent;
CREATE TRIGGER runs_runevent_append_only BEFORE UPDATE OR DELETE ON runs_runevent
    FOR EACH ROW EXECUTE FUNCTION agentops_events_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS runs_runevent_append_only ON runs_runevent;
CREATE TRIGGER runs_runevent_append_only BEFORE UPDATE OR DELETE ON runs_runevent
    FOR EACH ROW EXECUTE FUNCTION agentops_append_only();
DROP FUNCTION IF EXISTS agentops_events_append_only();
"""


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE, params=None)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):
    dependencies = [("runs", "0027_spend_caps")]

    operations = [
        migrations.CreateModel(
            name="VerifiedChain",
            fields=[
                (
                    "run",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="verified_chain",
                        serialize=False,
                        to="runs.run",
                    ),
                ),
                ("seq", models.PositiveBigIntegerField()),
                ("hash", models.CharField(max_length=64)),
                ("verified_at", models.DateTimeField()),
            ],
        ),
        migrations.CreateModel(
            name="ArchivedChain",
            fields=[
                (
                    "run",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.PROTECT,
                        primary_key=True,
                        related_name="archived_chain",
                        serialize=False,
                        to="runs.run",
                    ),
                ),
                ("month", models.DateField()),
                ("seq", models.PositiveBigIntegerField()),
                ("hash", models.CharField(max_length=64)),
                ("events", models.PositiveBigIntegerField()),
                ("first_event_id", models.BigIntegerField(null=True)),
                ("last_event_id", models.BigIntegerField(null=True)),
                ("export", models.CharField(max_length=300)),
                ("export_digest", models.CharField(max_length=64)),
                ("archived_at", models.DateTimeField()),
                ("dropped_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "indexes": [models.Index(fields=["month"], name="archivedchain_month_idx")],
            },
        ),
        migrations.RunPython(forwards, backwards),
    ]
