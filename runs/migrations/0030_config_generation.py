"""Configuration generations (runs.record.configcache): the ``principals`` token, moved by
triggers on users' names, group memberships and group names, so that every claim knows
whether a principal's groups changed — however they were changed (a service, the Django
admin, ``user.groups.add()``, raw SQL)."""

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import migrations, models

from runs.record.configcache import token_triggers_drop, token_triggers_install


def _watched(apps):
    user = apps.get_model(settings.AUTH_USER_MODEL)
    group = apps.get_model("auth", "Group")
    memberships = user._meta.get_field("groups").remote_field.through._meta.db_table
    # a historical model has no USERNAME_FIELD: the installed one says which it is
    username = user._meta.get_field(get_user_model().USERNAME_FIELD).column
    return [
        (memberships, [("INSERT", ()), ("DELETE", ()), ("UPDATE", ())]),
        (user._meta.db_table, [("UPDATE", (username,))]),
        (group._meta.db_table, [("UPDATE", ("name",))]),
    ]


def forwards(apps, schema_editor):
    token_triggers_install(schema_editor, name="principals", watched=_watched(apps))


def backwards(apps, schema_editor):
    token_triggers_drop(schema_editor, name="principals", watched=_watched(apps))


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0029_layout_choices"),
        ("auth", "0012_alter_user_first_name_max_length"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="ConfigGeneration",
            fields=[
                ("name", models.CharField(max_length=50, primary_key=True, serialize=False)),
                ("token", models.CharField(max_length=40)),
            ],
        ),
        migrations.RunPython(forwards, backwards),
    ]
