"""The auditor role reads every model (the admin site is theirs) and changes nothing.

Re-runs the idempotent role sync now that every model it names exists; 0002 ran before some
of them did and skipped their permissions.
"""

from django.db import migrations


def grant(apps, schema_editor):
    from approvals.roles import sync_roles

    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0003_links_comments_edits"),
        ("runs", "0007_question_links"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
