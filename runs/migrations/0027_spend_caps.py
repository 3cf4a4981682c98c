# Issue 26 item 3: spend and token caps by scope and period (runs.spend)

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0026_policy_toolcall_policy_input'),
    ]

    operations = [
        migrations.AlterField(
            model_name='alert',
            name='kind',
            field=models.CharField(choices=[('run_needs_attention', 'Run Needs Attention'), ('worker_stopped', 'Worker Stopped'), ('no_live_worker', 'No Live Worker'), ('spend_cap', 'Spend Cap')], max_length=30),
        ),
        migrations.CreateModel(
            name='SpendCap',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('scope', models.CharField(choices=[('agent', 'per agent'), ('principal', 'per principal'), ('principal_day', 'per principal per day'), ('global_day', 'everything per day')], max_length=20)),
                ('subject', models.CharField(blank=True, max_length=200)),
                ('max_cost', models.DecimalField(blank=True, decimal_places=6, max_digits=12, null=True)),
                ('max_tokens', models.PositiveBigIntegerField(blank=True, null=True)),
                ('set_by', models.CharField(blank=True, max_length=200)),
                ('reason', models.TextField(blank=True)),
                ('updated_at', models.DateTimeField(auto_now=True)),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('scope', 'subject'), name='spendcap_uniq')],
            },
        ),
        migrations.CreateModel(
            name='SpendCounter',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('scope', models.CharField(choices=[('agent', 'per agent'), ('principal', 'per principal'), ('principal_day', 'per principal per day'), ('global_day', 'everything per day')], max_length=20)),
                ('subject', models.CharField(blank=True, max_length=200)),
                ('period', models.CharField(blank=True, max_length=10)),
                ('cost_used', models.DecimalField(decimal_places=6, default=0, max_digits=14)),
                ('tokens_used', models.BigIntegerField(default=0)),
                ('cost_reserved', models.DecimalField(decimal_places=6, default=0, max_digits=14)),
                ('tokens_reserved', models.BigIntegerField(default=0)),
                ('cost_added', models.DecimalField(decimal_places=6, default=0, max_digits=14)),
                ('tokens_added', models.BigIntegerField(default=0)),
                ('warned_at', models.CharField(blank=True, max_length=100)),
                ('updated_at', models.DateTimeField(auto_now=True)),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('scope', 'subject', 'period'), name='spendcounter_uniq')],
            },
        ),
        migrations.CreateModel(
            name='SpendReservation',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('kind', models.CharField(choices=[('model', 'Model'), ('tool', 'Tool')], max_length=10)),
                ('incarnation', models.PositiveBigIntegerField(default=0)),
                ('cost', models.DecimalField(decimal_places=6, default=0, max_digits=12)),
                ('tokens', models.BigIntegerField(default=0)),
                ('state', models.CharField(choices=[('held', 'Held'), ('settled', 'Settled'), ('cut_off', 'Cut Off')], default='held', max_length=10)),
                ('cost_settled', models.DecimalField(blank=True, decimal_places=6, max_digits=12, null=True)),
                ('tokens_settled', models.BigIntegerField(blank=True, null=True)),
                ('counters', models.JSONField(blank=True, default=list)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('settled_at', models.DateTimeField(blank=True, null=True)),
                ('settled_by', models.CharField(blank=True, max_length=200)),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='runs.run')),
                ('tool_call', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='runs.toolcall')),
            ],
            options={
                'indexes': [models.Index(condition=models.Q(('state', 'settled'), _negated=True), fields=['run', 'kind'], name='spendres_open_idx'), models.Index(fields=['tool_call'], name='spendres_call_idx')],
            },
        ),
        migrations.CreateModel(
            name='SpendStop',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('since', models.DateTimeField(auto_now_add=True)),
                ('counter', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='stops', to='runs.spendcounter')),
                ('run', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='spend_stop', to='runs.run')),
            ],
        ),
    ]
