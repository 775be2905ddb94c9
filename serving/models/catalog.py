"""The model catalog: what a model is (entry), which files hold it (per node), and the jobs that fetch it."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from scheduler.policy.inputs import DesiredModel, Scaling


class ModelEntry(models.Model):
    """A model the mirror holds, or is fetching, with how it should be served.

    ``owner`` null means shared: every caller may see and deploy it; only administrators change it.
    ``fingerprint`` changes exactly when the source or a profile changes (``catalog.validation``).
    """

    class Task(models.TextChoices):
        CHAT = "chat", "Chat"
        COMPLETION = "completion", "Completion"
        EMBEDDING = "embedding", "Embedding"
        RERANK = "rerank", "Rerank"

    class Format(models.TextChoices):
        GGUF = "gguf", "GGUF"
        SAFETENSORS = "safetensors", "safetensors"

    class SourceKind(models.TextChoices):
        HUB = "hub", "Hub repository"
        LOCAL = "local", "Local path"
        PACKAGE = "package", "Python package"

    # An on-demand model (scaling minimum 0) with no idle timeout of its own is stopped after this long unused.
    DEFAULT_IDLE_SECONDS = 15 * 60

    class ServiceClass(models.TextChoices):
        # Unset: the placement policy decides (scheduler.policy.inputs.DesiredModel.effective_class).
        AUTOMATIC = "", "Automatic (opportunistic when on demand, else standard)"
        CRITICAL = "critical", "Critical"
        STANDARD = "standard", "Standard"
        OPPORTUNISTIC = "opportunistic", "Opportunistic"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    name = models.CharField(max_length=200, unique=True, help_text="The model name clients ask for.")
    aliases = models.JSONField(default=list, blank=True)
    description = models.TextField(blank=True)
    task = models.CharField(max_length=12, choices=Task.choices, default=Task.CHAT)
    owner = models.ForeignKey("tenancy.Scope", null=True, blank=True, on_delete=models.PROTECT,
                              related_name="catalog_models", help_text="Empty: shared with everyone.")
    source_kind = models.CharField(max_length=10, choices=SourceKind.choices)
    source_repo = models.CharField(max_length=300, blank=True, help_text="owner/name on the hub.")
    source_revision = models.CharField(max_length=64, blank=True, help_text="The pinned commit.")
    source_path = models.CharField(max_length=1024, blank=True)
    source_package = models.CharField(max_length=200, blank=True)
    format = models.CharField(max_length=12, choices=Format.choices)
    quantisation = models.CharField(max_length=40, blank=True)
    architecture = models.CharField(max_length=60, blank=True)
    profiles = models.JSONField(default=list, blank=True,
                                help_text="[{name, engine, file, context, parallel, cores, memory_bytes, priority}]")
    scaling_min = models.PositiveSmallIntegerField(default=0)
    scaling_max = models.PositiveSmallIntegerField(default=1)
    idle_timeout_seconds = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="An on-demand replica idle this long is stopped. Empty: the default (15 minutes).")
    service_class = models.CharField(max_length=16, choices=ServiceClass.choices, default=ServiceClass.AUTOMATIC,
                                     blank=True, help_text="Empty: opportunistic when on demand, else standard.")
    fallbacks = models.JSONField(default=list, blank=True,
                                 help_text="Models that serve in its place: while it has no ready replica, and as "
                                           "the recovery ladder's smaller model after running out of memory.")
    draft = models.CharField(max_length=200, blank=True,
                             help_text="A catalog model that drafts tokens for this one (speculative decoding), "
                                       "loaded in the same engine.")
    pinned = models.BooleanField(default=False, help_text="Always resident, even at minimum 0; its replicas are "
                                                          "never evicted or preempted.")
    max_output_tokens = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="The most tokens one request may generate: the gateway refuses more and sends this when the "
                  "request names none. Empty: no cap of its own (the context still bounds it).")
    fingerprint = models.CharField(max_length=16, blank=True, db_index=True)
    restart_requested_at = models.DateTimeField(
        null=True, blank=True,
        help_text="The last rolling restart asked: replicas started before it are replaced one at a time, the "
                  "new one ready before the old stops (serving.catalog.restarts).")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def effective_class(self) -> str:
        """The class the placement policy gives the model: its own, or when unset the policy's rule."""
        scaling = Scaling(min=self.scaling_min, max=self.scaling_max)
        return DesiredModel(self.name, (), scaling, capacity_class=self.service_class).effective_class


class ModelFile(models.Model):
    """One file of a model as held on one node. A quarantined file is never served."""

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    model = models.ForeignKey(ModelEntry, null=True, blank=True, on_delete=models.SET_NULL, related_name="files")
    node = models.ForeignKey("scheduler.Node", null=True, blank=True, on_delete=models.CASCADE,
                             related_name="model_files", help_text="Empty: the control plane's own disk.")
    repo_path = models.CharField(max_length=500, help_text="The file's path inside its repository or package.")
    path = models.CharField(max_length=1024, help_text="Where the file lies on the node.")
    size = models.BigIntegerField(null=True, blank=True)
    sha256 = models.CharField(max_length=64, blank=True, help_text="What arrived.")
    expected_sha256 = models.CharField(max_length=64, blank=True, help_text="What the hub publishes.")
    verified = models.BooleanField(default=False)
    quarantined = models.BooleanField(default=False)
    quarantine_reason = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["repo_path"]
        # Two partial constraints rather than nulls_distinct=False, which SQLite (the embedded mode)
        # lacks: a file is recorded once per node, and once on the control plane (node NULL).
        constraints = [
            models.UniqueConstraint(fields=["node", "path"], condition=models.Q(node__isnull=False),
                                    name="one_record_per_file_per_node"),
            models.UniqueConstraint(fields=["path"], condition=models.Q(node__isnull=True),
                                    name="one_record_per_file_on_the_control_plane"),
        ]

    def __str__(self) -> str:
        return self.path


class FetchJob(models.Model):
    """A fetch (or a whole serve-in-one-command) the worker runs: status, per-file progress, log, result."""

    class Kind(models.TextChoices):
        FETCH = "fetch", "Fetch"
        SERVE = "serve", "Serve"

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"
        REFUSED = "refused", "Refused"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    kind = models.CharField(max_length=8, choices=Kind.choices, default=Kind.FETCH)
    repo = models.CharField(max_length=300)
    revision = models.CharField(max_length=100, default="main", help_text="As asked.")
    commit = models.CharField(max_length=64, blank=True, help_text="The revision resolved and pinned.")
    files = models.JSONField(default=list, help_text="[{path, size, sha256, done_bytes, state}]")
    options = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED, db_index=True)
    steps = models.JSONField(default=list, blank=True, help_text="[{name, state, detail, at}] of a serve job.")
    log = models.TextField(blank=True)
    result = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    model = models.ForeignKey(ModelEntry, null=True, blank=True, on_delete=models.SET_NULL, related_name="fetch_jobs")
    owner = models.ForeignKey("tenancy.Scope", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.kind} {self.repo}@{self.commit[:8] or self.revision}"

    @property
    def total_bytes(self) -> int:
        return sum(f.get("size") or 0 for f in self.files)

    @property
    def done_bytes(self) -> int:
        return sum(f.get("done_bytes") or 0 for f in self.files)

    @property
    def percent(self) -> int | None:
        total = self.total_bytes
        return int(self.done_bytes * 100 / total) if total else None


class ProfileSpeed(models.Model):
    """How fast a catalog model's profile generates, measured on the requests the gateway served
    (``serving.catalog.speed``): tokens and generation seconds summed, older ones weighing less.
    The placement policy prefers, among profiles of equal priority, the most tokens/s per
    accelerator or core."""

    model = models.CharField(max_length=200, help_text="The catalog model's name.")
    profile = models.CharField(max_length=100)
    tokens = models.FloatField(default=0.0, help_text="Generated tokens counted (decayed).")
    seconds = models.FloatField(default=0.0, help_text="Seconds spent generating them (decayed alike).")
    requests = models.PositiveIntegerField(default=0, help_text="Requests measured in all.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model", "profile"]
        constraints = [models.UniqueConstraint(fields=["model", "profile"], name="one_speed_per_profile")]

    def __str__(self) -> str:
        return f"{self.model}/{self.profile}: {self.tokens_per_second:.1f} tokens/s"

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
