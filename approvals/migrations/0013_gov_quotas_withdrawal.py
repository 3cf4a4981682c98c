from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0012_layout_choices"),
    ]

    operations = [
        migrations.AddField(
            model_name="approval",
            name="group_minimums",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.AddField(
            model_name="approvalpolicyversion",
            name="withdraws",
            field=models.BooleanField(default=False),
        ),
    ]
