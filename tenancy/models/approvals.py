import uuid

from django.conf import settings
from django.db import models


class ApprovalRequest(models.Model):
    """A request that a second person allow one action on one subject, with the evidence it rests on.

    ``fingerprint`` is the SHA-256 of the canonical JSON of ``evidence``. When the action is carried
    out the evidence is rebuilt from the current state: a different fingerprint means the world
    changed since the approval, which is then stale and refused.
    """

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        APPROVED = "approved", "Approved"
        REJECTED = "rejected", "Rejected"
        USED = "used", "Used"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    scope = models.ForeignKey("tenancy.Scope", on_delete=models.CASCADE, related_name="approval_requests")
    action = models.CharField(max_length=100)
    subject_type = models.CharField(max_length=100)
    subject_id = models.CharField(max_length=64)
    subject_repr = models.CharField(max_length=300)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    reason = models.TextField()
    evidence = models.JSONField()
    fingerprint = models.CharField(max_length=64)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING, db_index=True)
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="+")
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.action} on {self.subject_repr} ({self.status})"
