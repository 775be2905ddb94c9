"""Usage records (one per request, no content) and model prices."""

from django.db import models


class UsageRecord(models.Model):
    """What one request through /v1/ did: who, which model and replica, how it went, how many tokens.

    Never the request's or the response's content. Written in batches a second or so after the
    request ends (``gateway.usage``)."""

    request_id = models.CharField(max_length=64, db_index=True)
    started_at = models.DateTimeField(db_index=True)
    finished_at = models.DateTimeField()
    endpoint = models.CharField(max_length=32)  # chat/completions, completions, embeddings, rerank
    stream = models.BooleanField(default=False)
    model_asked = models.CharField(max_length=200, blank=True)
    model_served = models.CharField(max_length=200, blank=True)
    replica_id = models.UUIDField(null=True, blank=True)
    status = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=64, blank=True)
    queue_ms = models.FloatField(null=True, blank=True)
    ttft_ms = models.FloatField(null=True, blank=True)
    total_ms = models.FloatField()
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    cost = models.DecimalField(max_digits=16, decimal_places=8, null=True, blank=True)
    credential = models.ForeignKey("tenancy.Credential", null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+", db_constraint=False)
    key_prefix = models.CharField(max_length=32, blank=True)
    client = models.ForeignKey("tenancy.ServiceClient", null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="+", db_constraint=False)
    project = models.ForeignKey("tenancy.Scope", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="+", db_constraint=False)
    scope_path = models.CharField(max_length=200, blank=True, db_index=True)

    class Meta:
        ordering = ["-started_at", "-id"]
        indexes = [models.Index(fields=["model_served", "started_at"], name="usage_model_time"),
                   models.Index(fields=["client", "started_at"], name="usage_client_time")]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model_asked} {self.status}"

    @property
    def total_tokens(self) -> int | None:
        if self.prompt_tokens is None and self.completion_tokens is None:
            return None
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)


class ModelPrice(models.Model):
    """What a model's tokens cost, per 1,000; turns usage into cost for reports."""

    model_name = models.CharField(max_length=200, unique=True)
    prompt_per_1k = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    completion_per_1k = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model_name"]

    def __str__(self) -> str:
        return f"{self.model_name}: {self.prompt_per_1k}/{self.completion_per_1k} per 1k"
