import uuid

from django.db import models


class Node(models.Model):
    """A machine of the fleet that runs Berth's agent and the engines it starts."""

    class State(models.TextChoices):
        READY = "ready", "Ready"
        CORDONED = "cordoned", "Cordoned"
        DRAINING = "draining", "Draining"
        LOST = "lost", "Lost"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    name = models.CharField(max_length=253, unique=True)
    address = models.CharField(max_length=255, help_text="Where engines on this node are reached.")
    labels = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.READY)
    cpu_count = models.PositiveIntegerField(null=True, blank=True)
    # Unknown is not zero: a figure the node did not report stays NULL.
    memory_total_bytes = models.BigIntegerField(null=True, blank=True)
    memory_available_bytes = models.BigIntegerField(null=True, blank=True)
    agent_version = models.CharField(max_length=64, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class NodeEngine(models.Model):
    """An inference engine a node has installed, as the node reported it."""

    class Kind(models.TextChoices):
        LLAMACPP = "llamacpp", "llama.cpp"
        VLLM = "vllm", "vLLM"

    class State(models.TextChoices):
        READY = "ready", "Ready"
        BROKEN = "broken", "Broken"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="engines")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    version = models.CharField(max_length=128)
    source = models.CharField(max_length=128, blank=True, help_text="What it was built or installed from.")
    path = models.CharField(max_length=1024, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.READY)
    detail = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node__name", "kind"]
        constraints = [models.UniqueConstraint(fields=["node", "kind"], name="one_engine_of_a_kind_per_node")]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} {self.version} on {self.node.name}"
