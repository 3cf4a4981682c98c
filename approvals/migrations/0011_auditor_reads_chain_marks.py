from django.db import migrations


def grant(apps, schema_editor):
    # auditors read the verified and archived chain heads (runs 0028; approvals.roles)
    from approvals.roles import sync_roles

    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0010_auditor_reads_limits_and_history"),
        ("runs", "0028_retention_chains"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
