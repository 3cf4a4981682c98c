from django.db import migrations


def grant(apps, schema_editor):
    # auditors read the spend caps' tables (approvals.roles, runs.spend)
    from approvals.roles import sync_roles

    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0013_gov_quotas_withdrawal"),
        ("runs", "0027_spend_caps"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
