from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0010_dispatch_deadlines'),
    ]

    operations = [
        migrations.AddField(
            model_name='toolcall',
            name='absent_lookup',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
    ]
