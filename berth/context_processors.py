from django.urls import reverse

from scheduler import reach
from scheduler.models import Node
from serving.control.watchdog import levels

# The console's areas, one per app in the order a request flows down through them, after the
# dashboard. Each has its sections: (label, URL name, fragment, the other URL names that belong to
# it, staff only). Organisations' pages draw their own sections (tenancy/nav.html), so it lists none.
AREAS = (
    ("", "Dashboard", "dashboard", ()),
    ("gateway", "Gateway", "gateway:index", (
        ("Usage", "gateway:index", "", (), False),
        ("Splits", "gateway:index", "#splits", (), False),
        ("Batches", "gateway:batches", "", ("batch", "batch_cancel"), False),
        ("Playground", "gateway:playground", "", (), False),
    )),
    ("serving", "Models", "serving:catalog-held", (
        ("Catalog", "serving:catalog-held", "",
         ("catalog-explore", "catalog-fetch", "catalog-card", "catalog-job", "catalog-serve"), False),
        ("Deployments", "serving:index", "", ("deployment", "reconfigure", "deployment-action"), False),
        ("Deploy", "serving:deploy", "", ("preview",), False),
    )),
    ("scheduler", "Fleet", "scheduler:index", (
        ("Nodes", "scheduler:index", "", ("node", "node-action"), False),
        ("Placement", "scheduler:placement", "", ("parked-retry",), False),
        ("Will it fit?", "scheduler:estimate", "", (), True),
    )),
    ("tenancy", "Organisations", "tenancy:index", ()),
)


def _mark(url: str, path: str, here: bool) -> str:
    """aria-current: "page" on the link to this very page, "true" on the area or section it lies in."""
    return "page" if url == path else ("true" if here else "")


def navigation(request):
    match = getattr(request, "resolver_match", None)
    namespace, name = (match.namespace, match.url_name) if match else (None, None)
    path = request.path
    staff = reach.sees_everything(getattr(request, "user", None))
    areas, sections, trail = [], [], []
    for key, label, url_name, area_sections in AREAS:
        active = namespace == key if key else (namespace == "" and name == "dashboard")
        url = reverse(url_name)
        areas.append({"key": key or "dashboard", "label": label, "url": url, "active": active,
                      "current": _mark(url, path, active)})
        if not active:
            continue
        trail.append((label, url))
        marked = False
        for section_label, section_url, fragment, members, staff_only in area_sections:
            if staff_only and not staff:
                continue
            url = reverse(section_url)
            # One section per page: the first whose URL names hold it (Usage, not Splits, on /gateway/).
            here = not marked and not fragment and (section_url == f"{namespace}:{name}" or name in members)
            marked = marked or here
            sections.append({"label": section_label, "url": url + fragment, "active": here,
                             "current": _mark(url, path, here) if not fragment else ""})
            if here:
                trail.append((section_label, url))
    # A record page's breadcrumbs start where the navigation stands (berth/breadcrumbs.html).
    return {"nav_areas": areas, "nav_sections": sections, "nav_trail": trail,
            "nav_area_label": next((a["label"] for a in areas if a["active"]), "")}


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
