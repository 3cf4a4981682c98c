from django.db import migrations


def grant(apps, schema_editor):
    # auditors read flow control's tables and the history's metadata (approvals.roles)
    from approvals.roles import sync_roles

    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0009_policy_versions"),
        ("runs", "0026_policy_toolcall_policy_input"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
