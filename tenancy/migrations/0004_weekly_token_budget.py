from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("tenancy", "0003_client_granted_by"),
    ]

    operations = [
        migrations.AddField(
            model_name="contract",
            name="weekly_token_budget",
            field=models.PositiveBigIntegerField(blank=True, null=True),
        ),
    ]
