from django.urls import reverse

from scheduler.models import Node
from serving.node.watchdog import levels

# The console's four areas, one per app, in the order a request flows down through them.
AREAS = (
    ("gateway", "Gateway", "gateway:index"),
    ("serving", "Models", "serving:index"),
    ("scheduler", "Fleet", "scheduler:index"),
    ("tenancy", "Organisations", "tenancy:index"),
)


def navigation(request):
    match = getattr(request, "resolver_match", None)
    current = match.namespace if match else ""
    return {
        "nav_areas": [
            {"key": key, "label": label, "url": reverse(name), "active": key == current}
            for key, label, name in AREAS
        ]
    }


def memory_banner(request):
    """Nodes whose memory the watchdog rates warning or critical, for the banner on every page (or,
    while the cache cannot be read, that the levels are not known)."""
    if not getattr(request, "user", None) or not request.user.is_authenticated:
        return {}
    known = levels(Node.objects.only("pk", "name"))
    if known is None:  # the cache (Redis) is away: say so, rather than show no alert as if all were well
        return {"memory_alerts": [], "memory_levels_unknown": True}
    alerts = [(name, level) for name, level in known.items() if level in ("warning", "critical")]
    return {"memory_alerts": alerts}
