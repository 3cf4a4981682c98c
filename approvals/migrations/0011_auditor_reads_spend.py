from django.db import migrations


def grant(apps, schema_editor):
    # auditors read the spend caps' tables (approvals.roles, runs.spend)
    from approvals.roles import sync_roles

    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0010_auditor_reads_limits_and_history"),
        ("runs", "0027_spend_caps"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
