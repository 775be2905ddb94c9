import uuid

from django.db import models

# The figures a contract may set: (field stem, label, unit) — a guarantee and a limit each.
CAPACITY_FIGURES = (
    ("gpu_memory_gib", "GPU memory", "GiB"),
    ("gpus", "GPUs", ""),
    ("cores", "CPU cores", ""),
)
# Rates and budgets are limits only.
RATE_FIGURES = (
    ("rpm_limit", "request rate", "requests/min"),
    ("tpm_limit", "token rate", "tokens/min"),
    ("concurrency_limit", "concurrent requests", ""),
    ("daily_token_budget", "daily token budget", "tokens"),
    ("weekly_token_budget", "weekly token budget", "tokens"),
    ("monthly_token_budget", "monthly token budget", "tokens"),
)


def _amount():
    return models.DecimalField(max_digits=12, decimal_places=2, null=True, blank=True)


class Contract(models.Model):
    """What one scope is guaranteed and limited to. Every figure is optional: unset means the
    scope adds no guarantee or limit of its own (its ancestors' still apply)."""

    class BudgetMode(models.TextChoices):
        HARD = "hard", "Hard (refuse)"
        SOFT = "soft", "Soft (warn)"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    scope = models.OneToOneField("tenancy.Scope", on_delete=models.CASCADE, related_name="contract")
    gpu_memory_gib_guarantee = _amount()
    gpu_memory_gib_limit = _amount()
    gpus_guarantee = _amount()
    gpus_limit = _amount()
    cores_guarantee = _amount()
    cores_limit = _amount()
    rpm_limit = models.PositiveIntegerField(null=True, blank=True)
    tpm_limit = models.PositiveBigIntegerField(null=True, blank=True)
    concurrency_limit = models.PositiveIntegerField(null=True, blank=True)
    daily_token_budget = models.PositiveBigIntegerField(null=True, blank=True)
    weekly_token_budget = models.PositiveBigIntegerField(null=True, blank=True)  # an ISO week, from Monday 00:00 UTC
    monthly_token_budget = models.PositiveBigIntegerField(null=True, blank=True)
    budget_mode = models.CharField(max_length=4, choices=BudgetMode.choices, default=BudgetMode.HARD)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["scope__path"]

    def __str__(self) -> str:
        return f"contract of {self.scope}"


class Reservation(models.Model):
    """What one holder (a replica, written by Serving) holds against a scope: the ledger that makes
    "what a scope holds" answerable without Tenancy reading any other app's tables."""

    scope = models.ForeignKey("tenancy.Scope", on_delete=models.PROTECT, related_name="reservations")
    scope_path = models.CharField(max_length=200, db_index=True, editable=False)
    holder = models.CharField(max_length=100, unique=True, help_text="e.g. replica:<uuid>")
    gpu_memory_gib = models.DecimalField(max_digits=12, decimal_places=2, default=0)
    gpus = models.DecimalField(max_digits=12, decimal_places=2, default=0)
    cores = models.DecimalField(max_digits=12, decimal_places=2, default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["scope_path", "holder"]

    def __str__(self) -> str:
        return f"{self.holder} on {self.scope_path}"
