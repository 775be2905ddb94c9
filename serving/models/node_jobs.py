"""Work for a node's agent: one leased row per job (``serving.control.node_jobs`` queues, leases and
settles them; the agent claims them through the node API)."""

import uuid

from django.db import models


class NodeJob(models.Model):
    """One thing a node is asked to do (start an engine, stop it, fetch weights, ...).

    A node claims its queued jobs, most urgent first (``priority``: lower first), and holds each under
    a lease it extends while it works; a lease that runs out returns the job to the queue, or fails
    it once ``max_attempts`` claims have been spent. Only the SHA-256 of the lease token is stored.
    """

    class Kind(models.TextChoices):
        START = "start", "Start"
        STOP = "stop", "Stop"
        SLEEP = "sleep", "Sleep"
        WAKE = "wake", "Wake"
        WATCH = "watch", "Watch"
        FETCH_WEIGHTS = "fetch_weights", "Fetch weights"
        PROBE = "probe", "Probe"

    class State(models.TextChoices):
        QUEUED = "queued", "Queued"
        LEASED = "leased", "Leased"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"

    # Priorities: maintenance never waits behind bulk work.
    MAINTENANCE, LIFECYCLE, BULK = 0, 1, 2
    OPEN = (State.QUEUED, State.LEASED)

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    node = models.ForeignKey("scheduler.Node", on_delete=models.CASCADE, related_name="jobs")
    replica = models.ForeignKey("serving.Replica", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="node_jobs")
    kind = models.CharField(max_length=20, choices=Kind.choices)
    priority = models.PositiveSmallIntegerField(default=BULK, help_text="Lower first: 0 maintenance, 2 bulk.")
    idempotency_key = models.CharField(max_length=200, unique=True,
                                       help_text="Asking twice with the same key queues one job.")
    payload = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    attempts = models.PositiveSmallIntegerField(default=0, help_text="Claims so far.")
    max_attempts = models.PositiveSmallIntegerField(default=3)
    lease_digest = models.CharField(max_length=64, blank=True, help_text="SHA-256 (hex) of the lease token held.")
    leased_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    available_at = models.DateTimeField(null=True, blank=True, help_text="Not claimable before; empty: at once.")
    cancel_requested = models.BooleanField(default=False,
                                           help_text="Asked to stop: the node hears it when it extends the lease.")
    result = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # A claim: a node's queued jobs in the order they are handed out.
            models.Index(fields=["node", "state", "priority", "created_at"], name="node_job_claim_order"),
            # The sweep: leases past their expiry.
            models.Index(fields=["state", "lease_expires_at"], name="node_job_lease_expiry"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} job {self.public_id} on node {self.node_id}"
