from datetime import timedelta

from django.apps import AppConfig
from django.conf import settings
from django.urls import reverse
from django.utils import timezone


class ServingConfig(AppConfig):
    """How a model runs: the model catalog and mirror, engines and runtimes, deployments and their replicas."""

    name = "serving"
    verbose_name = "Serving"

    def ready(self):
        # Imported here, once the apps are loaded (apps.py is read before any model): the placement
        # loop reads every app's models, and these registrations need it.
        from berth import health  # (as above: after the apps load)
        from scheduler import snapshot, views as scheduler_views  # (as above: after the apps load)
        from serving.control import node_work, placement  # (as above: after the apps load)

        node_work.register()  # what the nodes' jobs mean: start, watch, stop, sleep, wake
        # A node's page shows its staff the node's recent jobs.
        scheduler_views.register_node_section("Recent jobs", lambda node: reverse("serving:node-jobs",
                                                                                    args=[node.public_id]))
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
