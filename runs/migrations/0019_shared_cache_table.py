"""The database cache table (settings.CACHES): API throttle counters shared by every process
and machine (issue 17). Made here rather than by a separate ``createcachetable`` step, so a
deployment's ``migrate`` is still the only schema step; ``createcachetable`` is idempotent."""

from django.core.management import call_command
from django.db import migrations


def forwards(apps, schema_editor):
    call_command("createcachetable", database=schema_editor.connection.alias, verbosity=0)


class Migration(migrations.Migration):
    dependencies = [("runs", "0018_append_only_truncate_triggers")]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
