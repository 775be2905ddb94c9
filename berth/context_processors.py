from django.urls import reverse

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
