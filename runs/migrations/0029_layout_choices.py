# Choices only (issue 22): a signal's and an answer's channel, a call's effect class. No SQL.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0028_retention_chains"),
    ]

    operations = [
        migrations.AlterField(
            model_name="signal",
            name="channel",
            field=models.CharField(
                choices=[
                    ("web", "Web"),
                    ("email", "Email"),
                    ("api", "Api"),
                    ("admin", "Admin"),
                    ("cli", "Cli"),
                    ("worker", "Worker"),
                ],
                max_length=20,
            ),
        ),
        migrations.AlterField(
            model_name="question",
            name="channel",
            field=models.CharField(
                blank=True,
                choices=[
                    ("web", "Web"),
                    ("email", "Email"),
                    ("api", "Api"),
                    ("admin", "Admin"),
                    ("cli", "Cli"),
                    ("worker", "Worker"),
                ],
                max_length=20,
            ),
        ),
        migrations.AlterField(
            model_name="toolcall",
            name="effect",
            field=models.CharField(
                choices=[
                    ("read", "read"),
                    ("idempotent", "idempotent"),
                    ("reconcilable", "reconcilable"),
                    ("unsafe", "unsafe"),
                ],
                max_length=20,
            ),
        ),
    ]
