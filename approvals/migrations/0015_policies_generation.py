"""Configuration generations (runs.record.configcache): the ``policies`` token, moved by
triggers on approval policies and their versions, so that every claim knows whether which
tools have a published data policy may have changed — however it was changed (a service,
the Django admin, raw SQL)."""

from django.db import migrations

from runs.record.configcache import token_triggers_drop, token_triggers_install

WATCHED = [
    (
        "approvals_approvalpolicyversion",
        [("INSERT", ()), ("DELETE", ()), ("UPDATE", ("status", "withdraws", "policy_id"))],
    ),
    ("approvals_approvalpolicy", [("UPDATE", ("tool_name",))]),
]


def forwards(apps, schema_editor):
    token_triggers_install(schema_editor, name="policies", watched=WATCHED)


def backwards(apps, schema_editor):
    token_triggers_drop(schema_editor, name="policies", watched=WATCHED)


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0014_auditor_reads_spend"),
        ("runs", "0030_config_generation"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
