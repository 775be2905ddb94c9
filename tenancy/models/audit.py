import uuid

from django.conf import settings
from django.db import models


class AuditEvent(models.Model):
    """Who did what to which object, when and from where. Written in the same transaction as the
    change it records; never updated or deleted afterwards (the API and admin are read-only)."""

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor_user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    actor_client = models.ForeignKey("tenancy.ServiceClient", null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="+")
    actor = models.CharField(max_length=200, help_text="The actor as written when it acted (kept if it is deleted).")
    action = models.CharField(max_length=100, db_index=True)
    object_type = models.CharField(max_length=100)
    object_id = models.CharField(max_length=64, blank=True)
    object_repr = models.CharField(max_length=300, blank=True)
    scope = models.ForeignKey("tenancy.Scope", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    scope_path = models.CharField(max_length=200, blank=True, db_index=True)
    details = models.JSONField(default=dict, blank=True)
    address = models.GenericIPAddressField(null=True, blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.object_repr}"

    def save(self, *args, **kwargs):
        # Append-only: an event that exists is evidence and must not change.
        if self.pk is not None:
            raise ValueError("Audit events are append-only.")
        super().save(*args, **kwargs)
