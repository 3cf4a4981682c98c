"""The ``agent`` role (issue 16): service accounts that drive the remote agents they own.

Re-runs the idempotent role sync now that ``runs.drive_remote_run`` exists (runs 0016).
"""

from django.db import migrations


def grant(apps, schema_editor):
    from approvals.roles import sync_roles

    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0006_escalation_policy_copied"),
        ("runs", "0017_agent_manifest_owner_question_groups"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
