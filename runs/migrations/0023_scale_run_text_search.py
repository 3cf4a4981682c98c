"""The runs list's text search at a million runs (docs/benchmarks.md, "Scale"): a trigram
index for the goal (``icontains`` is ``UPPER(goal) LIKE UPPER(%text%)`` on PostgreSQL) and a
``jsonb_path_ops`` index for the searchable input fields (``input @> {field: text}``). Both
columns are written once, when a run is created: a checkpoint's update stays HOT.

PostgreSQL only (SQLite has neither; its search reads the table). ``pg_trgm`` is a trusted
extension: the database's owner, who runs ``migrate``, may create it (docs/operations.md)."""

from django.db import migrations

FORWARD = (
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    "CREATE INDEX IF NOT EXISTS run_goal_trgm_idx ON runs_run "
    "USING gin (UPPER(goal::text) gin_trgm_ops)",
    "CREATE INDEX IF NOT EXISTS run_input_path_idx ON runs_run USING gin (input jsonb_path_ops)",
)
BACKWARD = (
    "DROP INDEX IF EXISTS run_input_path_idx",
    "DROP INDEX IF EXISTS run_goal_trgm_idx",
)


def _run(statements):
    def apply(apps, schema_editor):
        if schema_editor.connection.vendor != "postgresql":
            return
        for statement in statements:
            schema_editor.execute(statement)

    return apply


class Migration(migrations.Migration):
    dependencies = [("runs", "0022_scale_run_list_indexes")]

    operations = [migrations.RunPython(_run(FORWARD), _run(BACKWARD), elidable=False)]
