import uuid

from django.conf import settings
from django.db import models


class ServiceClient(models.Model):
    """A machine identity of a project: what it may call, where, how fast, and how important it is."""

    class Environment(models.TextChoices):
        PRODUCTION = "production", "Production"
        STAGING = "staging", "Staging"
        DEVELOPMENT = "development", "Development"

    class Access(models.TextChoices):
        INFERENCE = "inference", "Inference"
        MANAGEMENT = "management", "Management"
        BOTH = "both", "Inference and management"

    class Priority(models.TextChoices):
        CRITICAL = "critical", "Critical"
        HIGH = "high", "High"
        NORMAL = "normal", "Normal"
        LOW = "low", "Low"
        BATCH = "batch", "Batch"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    project = models.ForeignKey("tenancy.Scope", on_delete=models.PROTECT, related_name="clients")
    name = models.CharField(max_length=100)
    description = models.CharField(max_length=300, blank=True)
    all_models = models.BooleanField(default=False, help_text="May call every model (else only allowed_models).")
    allowed_models = models.JSONField(default=list, blank=True)
    environment = models.CharField(max_length=12, choices=Environment.choices, default=Environment.DEVELOPMENT)
    access = models.CharField(max_length=12, choices=Access.choices, default=Access.INFERENCE)
    # Unset means "no limit of the client's own" (the tree's contracts still apply).
    rpm_limit = models.PositiveIntegerField(null=True, blank=True)
    tpm_limit = models.PositiveIntegerField(null=True, blank=True)
    concurrency_limit = models.PositiveIntegerField(null=True, blank=True)
    priority = models.CharField(max_length=8, choices=Priority.choices, default=Priority.NORMAL)
    is_active = models.BooleanField(default=True)
    # Whoever gave the client management access: it never acts above their role on its project, now
    # (demote them and the client follows). Unset: Berth itself gave it (manage.py as the system).
    # PROTECT, so that deleting the person cannot turn the client into one Berth itself trusts.
    granted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="+",
                                   help_text="Who gave it management access; it never acts above their role.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["project__path", "name"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="unique_client_name_in_project")]

    def __str__(self) -> str:
        return f"{self.project.path}/{self.name}"

    @property
    def may_infer(self) -> bool:
        return self.access in (self.Access.INFERENCE, self.Access.BOTH)

    @property
    def may_manage(self) -> bool:
        return self.access in (self.Access.MANAGEMENT, self.Access.BOTH)

    # A client authenticated by a management key is the API request's ``user``: these let DRF and
    # Django treat it as an authenticated principal without it being a person.
    is_authenticated = True
    is_anonymous = False
    is_superuser = False
    is_staff = False

    def get_username(self) -> str:
        return f"client:{self}"

    def allows_model(self, model: str) -> bool:
        return self.all_models or model in self.allowed_models


class Credential(models.Model):
    """An API key of a service client. The database holds only a keyed hash of its secret.

    A key reads ``brk_<lookup>_<secret>``: ``lookup`` finds the row through a unique index, the
    secret's HMAC-SHA256 under a pepper kept outside the database is compared in constant time.
    A stolen database therefore yields no usable key, and authentication is one indexed lookup.
    """

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    client = models.ForeignKey(ServiceClient, on_delete=models.CASCADE, related_name="credentials")
    name = models.CharField(max_length=100, blank=True)
    lookup = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.BinaryField(max_length=32, editable=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    # The expiry policy: a lifetime carried over to the key that replaces this one on rotation.
    lifetime = models.DurationField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    replaces = models.OneToOneField("self", null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="replaced_by")
    # The key's own limits, a level below its client's (unset: none of its own).
    rpm_limit = models.PositiveIntegerField(null=True, blank=True)
    tpm_limit = models.PositiveIntegerField(null=True, blank=True)
    concurrency_limit = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.prefix

    @property
    def prefix(self) -> str:
        """What may be shown of the key: enough to recognise it, nothing to use it."""
        return f"brk_{self.lookup}"
