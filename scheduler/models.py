import uuid

from django.db import models
from django.utils import timezone


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
    cpu_load_1m = models.FloatField(null=True, blank=True)
    unified_memory = models.BooleanField(
        default=False, help_text="CPU and GPU share one memory (e.g. GB10): the node's RAM is the GPU's budget.")
    gpu_source = models.CharField(max_length=32, blank=True, help_text="How the GPUs were read: nvml or nvidia-smi.")
    gpu_note = models.TextField(blank=True, help_text="What discovery said, e.g. why no GPUs were found.")
    driver_version = models.CharField(max_length=64, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # The node's own credential (``scheduler.enrolment``): ``bnc_<lookup>_<secret>``, of which only the
    # lookup and the secret's HMAC (with the key pepper, as API keys) are kept. No lookup: none issued.
    credential_lookup = models.CharField(max_length=12, unique=True, null=True, blank=True, editable=False)
    credential_digest = models.BinaryField(null=True, blank=True, editable=False)
    credential_issued_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True,
                                      help_text="Its credential was revoked: refused from then on, until another is "
                                                "issued (an enrolment token for this node, or `nodes credential`).")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def credential_state(self) -> str:
        """``none`` (never issued: a node from before enrolment), ``revoked`` or ``active``."""
        if self.revoked_at is not None:
            return "revoked"
        return "active" if self.credential_lookup else "none"


class EnrolmentToken(models.Model):
    """A one-time, expiring token an agent exchanges for its node's credential (``scheduler.enrolment``).

    ``bne_<lookup>_<secret>``: only the lookup and the secret's HMAC are kept; the plaintext is shown
    once, to whoever issued it. ``node`` is set for a token issued for a registered node
    (``nodes enrol --existing NAME``): the credential it gives is that node's. Otherwise ``name`` is
    the node it enrols, or blank when the agent says its own.
    """

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    lookup = models.CharField(max_length=12, unique=True, editable=False)
    digest = models.BinaryField(editable=False)
    name = models.CharField(max_length=253, blank=True, help_text="The node it enrols; blank: the agent says.")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, null=True, blank=True, related_name="enrolment_tokens",
                             help_text="The registered node whose credential it issues (--existing).")
    created_by = models.CharField(max_length=255, help_text="Who issued it (an actor, as the audit log writes it).")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    used_by_node = models.ForeignKey(Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        # Never the secret: this is what the audit log keeps as the object's name.
        return f"enrolment token bne_{self.lookup}_… for {self.name or 'a node the agent names'}"

    def state(self, now=None) -> str:
        """``used``, ``expired`` or ``pending``."""
        if self.used_at is not None:
            return "used"
        return "expired" if self.expires_at <= (now or timezone.now()) else "pending"


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


class Accelerator(models.Model):
    """A GPU, or one MIG instance of a GPU in MIG mode: the unit a replica is placed on.

    A card in MIG mode is kept for the record but is not placeable itself: its instances are
    (``parent`` points at the card). A replica on a MIG instance uses exactly that one instance.
    """

    class Kind(models.TextChoices):
        GPU = "gpu", "GPU"
        MIG = "mig", "MIG instance"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="accelerators")
    parent = models.ForeignKey("self", on_delete=models.CASCADE, null=True, blank=True, related_name="instances")
    kind = models.CharField(max_length=8, choices=Kind.choices, default=Kind.GPU)
    index = models.PositiveIntegerField(help_text="The card's index; for a MIG instance, its parent card's.")
    mig_index = models.PositiveIntegerField(null=True, blank=True)
    uuid = models.CharField(max_length=128)
    name = models.CharField(max_length=255, blank=True)
    accelerator_class = models.CharField(max_length=128, blank=True)
    profile = models.CharField(max_length=32, blank=True, help_text="MIG profile, e.g. 3g.40gb.")
    pci_bus_id = models.CharField(max_length=64, blank=True)
    mig_enabled = models.BooleanField(default=False)
    memory_total_bytes = models.BigIntegerField(null=True, blank=True)
    memory_used_bytes = models.BigIntegerField(null=True, blank=True)
    utilisation_percent = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    power_watts = models.FloatField(null=True, blank=True)
    power_limit_watts = models.FloatField(null=True, blank=True)
    throttle_reasons = models.JSONField(null=True, blank=True)  # null: not read; []: read, none active
    healthy = models.BooleanField(null=True, blank=True)
    health_reason = models.TextField(blank=True)
    placeable = models.BooleanField(default=True)
    unplaceable_reason = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node__name", "index", "mig_index"]
        constraints = [models.UniqueConstraint(fields=["node", "uuid"], name="one_accelerator_per_uuid_per_node")]

    def __str__(self) -> str:
        where = f"{self.index}" if self.mig_index is None else f"{self.index}/{self.mig_index}"
        return f"{self.accelerator_class or self.name} #{where} on {self.node.name}"


class AcceleratorSample(models.Model):
    """One telemetry reading of an accelerator; only the most recent few are kept."""

    accelerator = models.ForeignKey(Accelerator, on_delete=models.CASCADE, related_name="samples")
    taken_at = models.DateTimeField(db_index=True)
    memory_used_bytes = models.BigIntegerField(null=True, blank=True)
    utilisation_percent = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    power_watts = models.FloatField(null=True, blank=True)
    power_limit_watts = models.FloatField(null=True, blank=True)
    throttle_reasons = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-taken_at", "-id"]


class NodeSample(models.Model):
    """One telemetry reading of a node (CPU load, MemAvailable); only the most recent few are kept."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="samples")
    taken_at = models.DateTimeField(db_index=True)
    cpu_load_1m = models.FloatField(null=True, blank=True)
    memory_available_bytes = models.BigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-taken_at", "-id"]


class ModelDirectory(models.Model):
    """A directory a node watches for model weights."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="model_directories")
    path = models.CharField(max_length=1024)

    class Meta:
        ordering = ["path"]
        constraints = [models.UniqueConstraint(fields=["node", "path"], name="one_model_directory_per_path")]

    def __str__(self) -> str:
        return f"{self.node.name}:{self.path}"


class HeldWeight(models.Model):
    """A weights file (or a model folder) a node holds in one of its model directories."""

    directory = models.ForeignKey(ModelDirectory, on_delete=models.CASCADE, related_name="weights")
    path = models.CharField(max_length=1024)
    size_bytes = models.BigIntegerField(null=True, blank=True)
    format = models.CharField(max_length=32, blank=True)

    class Meta:
        ordering = ["path"]
        constraints = [models.UniqueConstraint(fields=["directory", "path"], name="one_held_weight_per_path")]


class MemoryReservation(models.Model):
    """Memory a deployment holds on a node (and accelerator), claimed under the node's lock.

    ``holder`` is the caller's stable name for what holds it (Serving passes its replica id);
    reserving again for the same holder replaces the figure.
    """

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="reservations")
    accelerator = models.ForeignKey(Accelerator, on_delete=models.CASCADE, null=True, blank=True,
                                    related_name="reservations")
    holder = models.CharField(max_length=255, unique=True)
    bytes = models.BigIntegerField()
    description = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["node__name", "created_at"]

    def __str__(self) -> str:
        return f"{self.holder}: {self.bytes} B on {self.node.name}"


class CalibrationRecord(models.Model):
    """What an engine really used for a model and configuration, against what was estimated.

    Keyed by model, engine, engine version, device and the configuration that matters
    (``config_key``, a canonical text of ``config``). An ``oom`` record exists only with evidence
    (the kernel OOM killer's line, Docker's OOMKilled, the engine's out-of-memory message).
    """

    class Outcome(models.TextChoices):
        LOADED = "loaded", "Loaded"
        OOM = "oom", "Out of memory"

    class Measurement(models.TextChoices):
        """How a load's ``measured_bytes`` was read (``scheduler.nvml``'s names for the GPU ones)."""

        PEAK_RSS = "peak_rss", "peak resident memory"
        PER_PROCESS = "process", "the engine's processes (NVML)"
        DEVICE_DELTA = "device_delta", "the device's use before and after the load (NVML)"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    model_key = models.CharField(max_length=255)
    model_name = models.CharField(max_length=255, blank=True)
    engine = models.CharField(max_length=16)
    engine_version = models.CharField(max_length=128)
    device = models.CharField(max_length=128, help_text="cpu, or the accelerator class.")
    config = models.JSONField(default=dict)
    config_key = models.CharField(max_length=512)
    estimated_bytes = models.BigIntegerField()
    measured_bytes = models.BigIntegerField(null=True, blank=True)
    outcome = models.CharField(max_length=8, choices=Outcome.choices)
    measurement = models.CharField(max_length=16, choices=Measurement.choices, blank=True,
                                   help_text="How measured_bytes was read; empty for a failure, or a load "
                                             "recorded before it was kept.")
    evidence = models.TextField(blank=True)
    node = models.ForeignKey(Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    holder = models.CharField(max_length=255, blank=True, db_index=True,
                              help_text="The reservation holder (a replica) whose load this was.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["model_key", "engine", "engine_version", "device"], name="calibration_key")]

    def __str__(self) -> str:
        return f"{self.model_name or self.model_key} on {self.engine} {self.engine_version} ({self.outcome})"


class PlacementDecision(models.Model):
    """One decision of the placement policy kept as evidence: a plan the reconciler applied, or a
    dry run someone asked for (explain, headroom). History is bounded (``SCHEDULER_DECISION_HISTORY``)."""

    class Kind(models.TextChoices):
        PLAN = "plan", "Applied plan"
        EXPLAIN = "explain", "Explain placement"
        HEADROOM = "headroom", "Headroom"

    class Verdict(models.TextChoices):
        PLACED = "placed", "Placed"
        PREEMPTED = "preempted", "Gave room"
        EVICTED = "evicted", "Evicted"
        UNSCHEDULABLE = "unschedulable", "Unschedulable"
        PARKED = "parked", "Parked"
        HELD = "held", "Held back"
        BACKOFF = "backoff", "Backing off"
        MOVING = "moving", "Moving"  # leaving a draining node, or a rolling restart's next
        DRY_RUN = "dry-run", "Dry run"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.PLAN)
    model = models.CharField(max_length=255, db_index=True, help_text="The catalog model the decision is about.")
    # Who may read the row: those who see this scope (and staff). None — a shared model, a stand-in,
    # a scope since deleted — is staff's only (scheduler.reach.visible_decisions).
    owner = models.ForeignKey("tenancy.Scope", on_delete=models.SET_NULL, null=True, blank=True, related_name="+",
                              help_text="The model's owner scope when the decision was made.")
    verdict = models.CharField(max_length=16, choices=Verdict.choices)
    reason_codes = models.JSONField(default=list)
    detail = models.TextField(blank=True)
    inputs_digest = models.CharField(max_length=32)
    fingerprint = models.CharField(max_length=32, help_text="The plan's fingerprint: equal plans, equal prints.")
    node = models.CharField(max_length=253, blank=True)
    accelerators = models.JSONField(default=list)
    victims = models.JSONField(default=list)
    headroom_before_bytes = models.BigIntegerField(null=True, blank=True)
    headroom_after_bytes = models.BigIntegerField(null=True, blank=True)
    evidence = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["model", "-created_at"], name="decision_model_recent")]

    def __str__(self) -> str:
        return f"{self.model}: {self.verdict} ({', '.join(self.reason_codes)})"


class DecisionTally(models.Model):
    """Decisions trimmed from the history (``placement_service.trim_history``), counted per model and
    verdict: a count over all time (``berth_model_preempted_total``) is what is kept plus this, so
    trimming never makes a counter go down (Prometheus would read that as a reset, and an increase)."""

    model = models.CharField(max_length=255)
    verdict = models.CharField(max_length=16, choices=PlacementDecision.Verdict.choices)
    count = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model", "verdict"], name="one_tally_per_model_and_verdict")]

    def __str__(self) -> str:
        return f"{self.model}: {self.count} {self.verdict} trimmed"


class RecoveryState(models.Model):
    """The recovery ladder's memory for one catalog model: its launch failures in a row, how far
    down the ladder it is, and whether it is parked (``scheduler.recovery_service`` writes it;
    the placement policy reads it as ``Snapshot.failures``).

    A parked model is not placed again until its definition changes (the catalog fingerprint no
    longer equals ``parked_fingerprint``) or an operator retries it. A reset row is kept: who
    retried it last, and the last error, stay visible.
    """

    class Kind(models.TextChoices):
        CRASH = "crash", "Crash"
        OOM = "oom", "Out of memory"
        HANG = "hang", "Hang"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    model = models.CharField(max_length=255, unique=True, help_text="The catalog model's name.")
    kind = models.CharField(max_length=8, choices=Kind.choices, blank=True,
                            help_text="The last failure's kind; empty when there is nothing to recover from.")
    consecutive = models.PositiveIntegerField(default=0, help_text="Failed launches in a row.")
    last_failure_at = models.DateTimeField(null=True, blank=True)
    level = models.PositiveSmallIntegerField(default=0, help_text="0 full, 1 degraded, 2 minimal (the last rung: smallest context, one slot, on the CPU where the engine can).")
    fingerprint = models.CharField(max_length=32, blank=True,
                                   help_text="The catalog definition the last failure was with.")
    parked = models.BooleanField(default=False)
    parked_at = models.DateTimeField(null=True, blank=True)
    parked_fingerprint = models.CharField(max_length=32, blank=True,
                                          help_text="The definition it was parked with: a new one unparks it.")
    last_error = models.TextField(blank=True)
    retried_by = models.CharField(max_length=255, blank=True, help_text="Who last asked for a retry (actor).")
    retried_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model"]

    def __str__(self) -> str:
        if self.parked:
            return f"{self.model}: parked after {self.consecutive} {self.kind} failure(s)"
        return f"{self.model}: {self.consecutive} {self.kind or 'no'} failure(s) in a row"
