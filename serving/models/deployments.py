"""Deployments of a model with one engine configuration, their replicas, events and operations."""

import uuid

from django.conf import settings
from django.db import models

from serving.models.states import HOLDING, DeploymentState


class Deployment(models.Model):
    """One model run with one engine configuration, as one or more replicas on a node."""

    State = DeploymentState

    class Engine(models.TextChoices):
        LLAMACPP = "llamacpp", "llama.cpp"
        VLLM = "vllm", "vLLM"

    class Runtime(models.TextChoices):
        PROCESS = "process", "Process"
        DOCKER = "docker", "Docker"

    class Task(models.TextChoices):
        CHAT = "chat", "Chat"
        COMPLETION = "completion", "Completion"
        EMBEDDING = "embedding", "Embedding"
        RERANK = "rerank", "Rerank"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    name = models.CharField(max_length=200, help_text="The model name clients ask for.")
    task = models.CharField(max_length=12, choices=Task.choices, default=Task.CHAT)
    engine = models.CharField(max_length=12, choices=Engine.choices, default=Engine.LLAMACPP)
    runtime = models.CharField(max_length=12, choices=Runtime.choices, default=Runtime.PROCESS)
    model_path = models.CharField(max_length=1024)
    config = models.JSONField(default=dict, blank=True, help_text="The engine's validated configuration.")
    profile = models.CharField(max_length=100, blank=True,
                               help_text="The catalog profile it runs; empty when deployed by hand.")
    node = models.ForeignKey("scheduler.Node", on_delete=models.PROTECT, related_name="deployments")
    gpu_uuids = models.JSONField(default=list, blank=True)
    owner = models.ForeignKey("tenancy.Scope", null=True, blank=True, on_delete=models.PROTECT,
                              related_name="deployments")
    priority = models.PositiveSmallIntegerField(default=50, help_text="0 (least) to 100 (most important).")
    replicas = models.PositiveSmallIntegerField(default=1)
    cores = models.PositiveSmallIntegerField(null=True, blank=True)
    memory_reserved_bytes = models.BigIntegerField(null=True, blank=True)
    estimate = models.JSONField(default=dict, blank=True, help_text="The estimate's breakdown at deploy time.")
    # A node that does not hold the catalog's files fetches them into its own model root first
    # (``serving.node.weights``): where the engine finds ``model_path`` there, and what to fetch.
    node_path = models.CharField(max_length=1024, blank=True,
                                 help_text="Where the engine finds the model on its node; empty: at model_path.")
    transfers = models.JSONField(default=list, blank=True,
                                 help_text="[{file, to, size, sha256}]: the mirror's files its node fetches first.")
    state = models.CharField(max_length=12, choices=State.choices, default=State.PLANNED, db_index=True)
    state_detail = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.get_engine_display()} on {self.node_id and self.node.name})"

    @property
    def path_on_node(self) -> str:
        """Where its engine finds the model on its node: its own copy, or the catalog's path itself."""
        return self.node_path or self.model_path


class Replica(models.Model):
    """One running (or once running) engine of a deployment."""

    State = DeploymentState

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replica_set")
    node = models.ForeignKey("scheduler.Node", on_delete=models.PROTECT, related_name="replicas")
    port = models.PositiveIntegerField()
    state = models.CharField(max_length=12, choices=State.choices, default=State.PLANNED, db_index=True)
    handle = models.JSONField(default=dict, blank=True, help_text="How the runtime finds the engine again.")
    memory_reserved_bytes = models.BigIntegerField(null=True, blank=True)
    peak_memory_bytes = models.BigIntegerField(null=True, blank=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    wake_requested_at = models.DateTimeField(
        null=True, blank=True,
        help_text="A wake asked for and not finished: its place in the start-up line, with queued starts.")
    waking_since = models.DateTimeField(null=True, blank=True,
                                        help_text="The wake in progress has held a start-up slot since then.")
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    exit_reason = models.CharField(max_length=300, blank=True)
    waits_for = models.JSONField(default=list, blank=True,
                                 help_text="Replicas stopped to make room for this one: it starts once they have.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [
            # A port is held by at most one replica per node while the replica holds resources.
            models.UniqueConstraint(fields=["node", "port"], condition=models.Q(state__in=HOLDING),
                                    name="one_holder_per_node_port"),
        ]

    def __str__(self) -> str:
        return f"replica {self.public_id} of {self.deployment.name}"


class DeploymentEvent(models.Model):
    """Every state change of a deployment or its replicas, with the engine's log tail on failure."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="events")
    replica = models.ForeignKey(Replica, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    from_state = models.CharField(max_length=12, blank=True)
    to_state = models.CharField(max_length=12)
    message = models.TextField(blank=True)
    log_tail = models.TextField(blank=True)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.deployment.name}: {self.from_state or '—'} → {self.to_state}"
class Operation(models.Model):
    """A switch (A → B), a reconfiguration, or a deploy that first sleeps or stops other deployments:
    run in the background step by step, its steps undone in reverse order if it cannot finish."""

    class Kind(models.TextChoices):
        SWITCH = "switch", "Switch"
        RECONFIGURE = "reconfigure", "Reconfigure"
        DEPLOY = "deploy", "Deploy after freeing memory"

    class State(models.TextChoices):
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        ROLLED_BACK = "rolled_back", "Rolled back"
        ROLLBACK_INCOMPLETE = "rollback_incomplete", "Rollback incomplete"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    kind = models.CharField(max_length=12, choices=Kind.choices)
    state = models.CharField(max_length=20, choices=State.choices, default=State.RUNNING, db_index=True)
    source = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    target = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    request = models.JSONField(help_text="What B is: the deploy request, as given (and the chosen actions).")
    steps = models.JSONField(default=list, blank=True, help_text="[{step, status, message, at}] in order.")
    message = models.TextField(blank=True)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} of {self.source.name if self.source else '—'} ({self.state})"

