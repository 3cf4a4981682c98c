# Choices only (issue 22): an approval's on-expiry action, a decision's channel. No SQL.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0011_auditor_reads_chain_marks"),
        ("runs", "0029_layout_choices"),
    ]

    operations = [
        migrations.AlterField(
            model_name="approval",
            name="on_expiry",
            field=models.CharField(
                choices=[("reject", "Reject"), ("terminate", "Terminate"), ("escalate", "Escalate")],
                default="reject",
                max_length=20,
            ),
        ),
        migrations.AlterField(
            model_name="approvaldecision",
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
    ]
