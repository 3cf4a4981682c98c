"""Auditors read the outbox (runs 0015) in the admin, like every other record: the role sync
runs again now that ``runs.view_outboxmessage`` exists."""

from django.db import migrations


def grant(apps, schema_editor):
    from approvals.roles import sync_roles

    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0007_agent_role"),
        ("runs", "0019_shared_cache_table"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
