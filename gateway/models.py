"""Usage records (one per request, no content) and model prices."""

import uuid

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


class ModelSplit(models.Model):
    """A canary or experiment: requests for ``model_name`` are served by its ``variants`` by weight,
    sticky per client (a stable hash of the client's id picks the variant, so one client always sees
    the same one while the split stands). ``environments`` limits who may call ``model_name`` at all
    (the clients' environments; empty: any); a split with no variants is only that restriction.

    A split of a scope applies to the clients of that scope and below (the most specific one wins);
    a split without a scope applies to every client and is for staff to manage. The gateway reads
    splits with the routing table, never per request."""

    ENVIRONMENTS = ("production", "staging", "development")

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    model_name = models.CharField(max_length=200)
    scope = models.ForeignKey("tenancy.Scope", null=True, blank=True, on_delete=models.CASCADE,
                              related_name="+")
    variants = models.JSONField(default=list, blank=True)  # [{"model": name, "weight": positive int}]
    environments = models.JSONField(default=list, blank=True)  # allowed client environments; [] = any
    enabled = models.BooleanField(default=True)
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model_name", "scope__path"]
        constraints = [
            models.UniqueConstraint(fields=["model_name", "scope"], name="gateway_split_model_scope"),
            models.UniqueConstraint(fields=["model_name"], condition=models.Q(scope__isnull=True),
                                    name="gateway_split_model_fleet"),
        ]

    def __str__(self) -> str:
        parts = ", ".join(f"{v['model']}:{v['weight']}" for v in self.variants or ())
        return f"{self.model_name} → {parts or '(as asked)'}"


class BatchFile(models.Model):
    """A file of the Batch API: a batch's input (JSONL uploaded through ``/v1/files``) or the output and
    errors a batch wrote. Its bytes live under the data directory (``gateway.batch.files``), never in the
    database; the row says whose it is. Only its service client sees it."""

    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    public_id = models.CharField(max_length=40, unique=True, editable=False)  # file-…
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    lines = models.PositiveIntegerField(null=True, blank=True)  # requests in a batch input
    endpoints = models.JSONField(default=list, blank=True)  # the urls its lines name (a batch input)
    model_names = models.JSONField(default=list, blank=True)  # the models its lines name (a batch input)
    client = models.ForeignKey("tenancy.ServiceClient", on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.public_id} {self.filename}"


class Batch(models.Model):
    """A batch of requests run by Celery workers through the gateway at the batch priority
    (``gateway.batch.runner``, one worker at a time: it holds the lease ``batch:<public_id>`` of
    ``berth.lease``); its lines are ``BatchLine`` rows, each sent once."""

    class Status(models.TextChoices):
        VALIDATING = "validating"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        FAILED = "failed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    public_id = models.CharField(max_length=40, unique=True, editable=False)  # batch_…
    endpoint = models.CharField(max_length=64)
    completion_window = models.CharField(max_length=8)  # as asked ("24h")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING, db_index=True)
    metadata = models.JSONField(default=dict, blank=True)
    errors = models.JSONField(null=True, blank=True)  # why it failed, in OpenAI's shape
    input_file = models.ForeignKey(BatchFile, null=True, on_delete=models.SET_NULL, related_name="+")
    output_file = models.ForeignKey(BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # The key that created it: its requests are that key's (its limits, budgets, revocation), at the batch priority.
    credential = models.ForeignKey("tenancy.Credential", on_delete=models.CASCADE, related_name="+")
    client = models.ForeignKey("tenancy.ServiceClient", on_delete=models.CASCADE, related_name="+")
    scope_path = models.CharField(max_length=200, db_index=True)  # the client's project, for the console's scoping
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()  # the end of its completion window
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.public_id} {self.status}"


class BatchLine(models.Model):
    """One request of a batch. The gateway claims it (pending → running) before it sends it to an engine
    and writes its answer (done or failed) before it answers the worker: a line is sent at most once,
    whoever dies when. Its answer is kept only while the batch lives."""

    class State(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    index = models.PositiveIntegerField()  # its line in the input file, from 0
    custom_id = models.CharField(max_length=200)
    state = models.CharField(max_length=8, choices=State.choices, default=State.PENDING)
    request_id = models.CharField(max_length=64, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    response = models.TextField(blank=True)  # the answer's body as the engine (or the gateway) gave it
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)

    class Meta:
        ordering = ["batch", "index"]
        constraints = [models.UniqueConstraint(fields=["batch", "index"], name="gateway_batchline_index")]
        indexes = [models.Index(fields=["batch", "state"], name="gateway_batchline_state")]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.index} {self.state}"
