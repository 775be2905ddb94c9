import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

MANAGING = ("management", "both")


def granted_by_from_the_audit_log(apps, schema_editor):
    """Existing management clients get, as their granter, the person the audit log names as having
    given them management access last (on creation or by an update), so a client a member made before
    this migration acts as a member from now on. Where the log names no person (Berth itself, or no
    event), the client stays as it was: an admin of its project."""
    ServiceClient = apps.get_model("tenancy", "ServiceClient")
    AuditEvent = apps.get_model("tenancy", "AuditEvent")
    for client in ServiceClient.objects.filter(access__in=MANAGING).iterator():
        events = (AuditEvent.objects.filter(object_type="tenancy.serviceclient", object_id=str(client.public_id),
                                            action__in=("client.create", "client.update"))
                  .order_by("-at", "-id"))
        for event in events:
            details = event.details or {}
            given = details.get("access") if event.action == "client.create" else (details.get("after") or {}).get("access")
            if event.action == "client.create" or given in MANAGING:
                if event.actor_user_id is not None:
                    client.granted_by_id = event.actor_user_id
                    client.save(update_fields=["granted_by"])
                break


class Migration(migrations.Migration):

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ('tenancy', '0002_key_limits'),
    ]

    operations = [
        migrations.AddField(
            model_name='serviceclient',
            name='granted_by',
            field=models.ForeignKey(blank=True, help_text='Who gave it management access; it never acts above their role.', null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.RunPython(granted_by_from_the_audit_log, migrations.RunPython.noop),
    ]
