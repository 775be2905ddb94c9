from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('scheduler', '0008_decision_moving'),
    ]

    operations = [
        migrations.AddField(
            model_name='calibrationrecord',
            name='measurement',
            field=models.CharField(blank=True, choices=[('peak_rss', 'peak resident memory'), ('process', "the engine's processes (NVML)"), ('device_delta', "the device's use before and after the load (NVML)")], help_text='How measured_bytes was read; empty for a failure, or a load recorded before it was kept.', max_length=16),
        ),
        migrations.AddField(
            model_name='calibrationrecord',
            name='holder',
            field=models.CharField(blank=True, db_index=True, help_text='The reservation holder (a replica) whose load this was.', max_length=255),
        ),
    ]
