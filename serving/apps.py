from datetime import timedelta

from django.apps import AppConfig
from django.conf import settings
from django.utils import timezone


class ServingConfig(AppConfig):
    """How a model runs: the model catalog and mirror, engines and runtimes, deployments and their replicas."""

    name = "serving"
    verbose_name = "Serving"

    def ready(self):
        # Imported here, once the apps are loaded (apps.py is read before any model): the placement
        # loop reads every app's models, and these registrations need it.
        from berth import health  # (as above: after the apps load)
        from scheduler import snapshot  # (as above: after the apps load)
        from serving.control import placement  # (as above: after the apps load)

        # Explain and headroom dry runs see the running system's replicas, as the reconcile loop does.
        snapshot.register_provider(placement.snapshot)
        # /readyz lists the agents seen; for information: a control plane without nodes can still be ready.
        health.register("agents", agents_seen, required=False)


def agents_seen() -> tuple[str, dict]:
    """Nodes whose agent sent a heartbeat within ``SCHEDULER_NODE_LOST_AFTER``, and those lost."""
    from scheduler.models import Node  # imported here: apps.py is read before the models are loaded

    cutoff = timezone.now() - timedelta(seconds=settings.SCHEDULER_NODE_LOST_AFTER)
    fresh = Node.objects.filter(last_heartbeat_at__gte=cutoff).exclude(state=Node.State.LOST).count()
    lost = Node.objects.filter(state=Node.State.LOST).count()
    return ("ok" if fresh else "none_seen"), {"fresh": fresh, "lost": lost}
