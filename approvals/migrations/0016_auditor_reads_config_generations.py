from django.db import migrations


def grant(apps, schema_editor):
    # auditors read the configuration generations (runs 0030; approvals.roles)
    from approvals.roles import sync_roles

    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0015_policies_generation"),
        ("runs", "0030_config_generation"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
