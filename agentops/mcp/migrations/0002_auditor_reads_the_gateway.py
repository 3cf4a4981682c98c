from django.db import migrations


def grant(apps, schema_editor):
    # auditors read the gateway's sessions and calls in the admin (approvals.roles)
    from approvals.roles import sync_roles

    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("mcp", "0001_initial"),
        ("approvals", "0010_auditor_reads_limits_and_history"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
