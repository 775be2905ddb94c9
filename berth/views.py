from datetime import datetime, timedelta

from django.contrib.auth.mixins import LoginRequiredMixin
from django.db.models import Count, Q, Sum
from django.http import JsonResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.views.defaults import page_not_found, server_error as default_server_error

from berth.api import error_body
from berth.htmx import PageView
from gateway import charts, services as usage_services
from serving.api.status import figures as status_figures
from serving.models.states import PRECEDENCE
from tenancy import access
from tenancy.models import ApprovalRequest

# --- the dashboard -----------------------------------------------------------------------------

POLL_SECONDS = 5
NODES_SHOWN = 12  # the rest are one link away, on the Fleet page
MODELS_SHOWN = 10
APPROVALS_SHOWN = 5
HOURS = 24
LEVELS = ("critical", "warning", "ok")  # worst first


def _percent(part: int, whole: int) -> float:
    return round(min(100.0, part * 100 / whole), 1) if whole else 0.0


def gib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**30:,.1f} GiB"


def _short(value: int) -> str:
    number = value / 2**30
    return f"{number:,.0f}" if number >= 10 else f"{number:,.1f}"


def memory_bar(row: dict) -> dict:
    """One memory row of the status as a bar: reserved, then what the devices measure beyond it,
    then free; a tick where the measured use ends. A figure not read stays "not measured"."""
    total, reserved, measured = row["total_bytes"], row["reserved_bytes"], row["measured_bytes"]
    beyond = 0 if measured is None else max(0, measured - reserved)
    said = "not measured" if measured is None else f"{gib(measured)} measured"
    return {**row, "known": bool(total), "reserved_pct": _percent(reserved, total),
            "text": f"{gib(reserved)} reserved · {said} · {gib(row['free_bytes'])} free of {gib(total)}",
            "free_of_total": f"{_short(row['free_bytes'])} of {_short(total)} GiB", "reserved_text": gib(reserved),
            "beyond_pct": _percent(beyond, total) if reserved < total else 0.0,
            "measured_pct": None if measured is None else _percent(measured, total)}


def memory_by_class(memory: list[dict]) -> list[dict]:
    """The nodes' accelerator rows summed per class, as bars (measured: not known when any node's is not)."""
    classes: dict[str, dict] = {}
    for node in memory:
        for row in node["memory"]:
            if row["kind"] != "accelerator":
                continue
            into = classes.setdefault(row["device"], {"kind": "accelerator", "device": row["device"], "units": 0,
                                                      "nodes": 0, "total_bytes": 0, "reserved_bytes": 0,
                                                      "measured_bytes": 0, "free_bytes": 0})
            into["nodes"] += 1
            for key in ("units", "total_bytes", "reserved_bytes", "free_bytes"):
                into[key] += row[key]
            into["measured_bytes"] = (None if into["measured_bytes"] is None or row["measured_bytes"] is None
                                      else into["measured_bytes"] + row["measured_bytes"])
    return [memory_bar(classes[name]) for name in sorted(classes)]


def watchdog_level(nodes: list[dict]) -> dict:
    """The worst memory level among the nodes, those at warning or worse, and how many are not known."""
    known = [n for n in nodes if n["watchdog"] is not None]
    worst = next((level for level in LEVELS if any(n["watchdog"] == level for n in known)), None)
    return {"level": worst, "alerts": [n for n in known if n["watchdog"] in ("critical", "warning")],
            "unknown": len(nodes) - len(known)}


def hourly_usage(visible, now) -> dict:
    """Requests (answered and refused) and tokens per hour over the last ``HOURS``, the current hour
    last: one aggregate query over the usage rows the viewer may see."""
    end = timezone.localtime(now).replace(minute=0, second=0, microsecond=0)
    hours = [end - timedelta(hours=HOURS - 1 - i) for i in range(HOURS)]
    rows = (visible.filter(started_at__gte=hours[0]).annotate(hour=usage_services.bucket("started_at", "hour"))
            .values("hour").annotate(requests=Count("id"), refused=Count("id", filter=Q(status__gte=400)),
                                     prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")).order_by("hour"))
    found = {usage_services.bucket_start(row["hour"], "hour"): row for row in rows}
    buckets = [{"hour": hour, "requests": found.get(hour, {}).get("requests", 0),
                "refused": found.get(hour, {}).get("refused", 0),
                "prompt": found.get(hour, {}).get("prompt") or 0,
                "completion": found.get(hour, {}).get("completion") or 0} for hour in hours]
    labels = [f"{b['hour']:%H}:00" for b in buckets]
    totals = {key: sum(b[key] for b in buckets) for key in ("requests", "refused", "prompt", "completion")}
    totals["tokens"] = totals["prompt"] + totals["completion"]
    return {
        "buckets": buckets, "totals": totals, "since": hours[0],
        "figures": {key: f"{value:,}" for key, value in totals.items()},
        "requests_chart": charts.stacked_bars(
            "Requests per hour, last 24 h", labels,
            {"answered": [b["requests"] - b["refused"] for b in buckets], "refused": [b["refused"] for b in buckets]}),
        "tokens_chart": charts.stacked_bars(
            "Tokens per hour, last 24 h", labels,
            {"prompt": [b["prompt"] for b in buckets], "completion": [b["completion"] for b in buckets]}),
    }


def latency(visible) -> list[dict]:
    """p50 and p95 of total time per model over the last day (the usage page's query), as bars
    against the slowest p95 shown."""
    rows = usage_services.latency_by_model(visible, days=1)
    top = max((row["p95"] or 0 for row in rows), default=0)
    return [{**row, "p50_pct": _percent(row["p50"] or 0, top), "p95_pct": _percent(row["p95"] or 0, top),
             "url": reverse("gateway:index") + "?" + urlencode({"model": row["model_served"]})} for row in rows]


def approvals_waiting(user, now) -> list:
    """What the viewer may decide now, as the approvals inbox lists it: pending, unexpired, asked by
    someone else, in a scope where the viewer may decide."""
    pending = (access.visible_to(user, ApprovalRequest.objects.select_related("scope", "requested_by"))
               .filter(status=ApprovalRequest.Status.PENDING, expires_at__gt=now).exclude(requested_by=user)
               .order_by("-created_at"))
    return [a for a in pending if access.can(user, "decide", a)]


def _deployments(counts: dict[str, int]) -> dict:
    return {"total": sum(counts.values()),
            "states": [(state, counts[state], reverse("serving:index") + "?" + urlencode({"state": state}))
                       for state in PRECEDENCE if counts.get(state)]}


class DashboardView(LoginRequiredMixin, PageView):
    """The landing page: the figures of ``manage.py status`` (``serving.api.status.figures``, the same
    function), the last day's requests, tokens and latency, and what waits for the viewer, each
    linking to the page behind it. Everything is narrowed to the viewer as those pages narrow it;
    the fleet's memory is everyone's, as on the Fleet page. The fragment polls itself."""

    template_name = "dashboard.html"
    fragment_template_name = "dashboard_fragment.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        user, now = self.request.user, timezone.now()
        data = status_figures(user)
        usage = usage_services.visible_usage(user)
        models = sorted(data["models"], key=lambda m: (m["satisfied"], m["name"]))  # the unsatisfied first
        ids = {m["name"]: m["public_id"] for m in data["models"]}
        node_ids = {n["node"]: n["node_id"] for n in data["memory"]}
        waiting = approvals_waiting(user, now)
        context.update(
            poll_seconds=POLL_SECONDS, status=data,
            nodes=[{**node, "bars": [memory_bar(row) for row in node["memory"]]}
                   for node in data["memory"][:NODES_SHOWN]],
            nodes_hidden=max(0, len(data["memory"]) - NODES_SHOWN),
            nodes_ready=sum(n["state"] == "ready" for n in data["nodes"]),
            classes=memory_by_class(data["memory"]),
            watchdog=watchdog_level(data["nodes"]),
            failures=[{**f, "at": datetime.fromisoformat(f["at"]), "node_id": node_ids.get(f["node"])}
                      for f in data["failures"]],
            models=models[:MODELS_SHOWN], models_hidden=max(0, len(models) - MODELS_SHOWN),
            parked=[{**p, "public_id": ids.get(p["name"])} for p in data["parked"]],
            unplaceable=[{**u, "public_id": ids.get(u["name"])} for u in data["unplaceable"]],
            deployments=_deployments(data["deployments"]),
            usage=hourly_usage(usage, now), latency=latency(usage),
            usage_url=reverse("gateway:index") + "?" + urlencode({"since": (now - timedelta(hours=HOURS)).isoformat()}),
            approvals=waiting[:APPROVALS_SHOWN], approvals_count=len(waiting),
        )
        return context


# --- the rest of the console's wiring ------------------------------------------------------------

class AreaPlaceholderView(LoginRequiredMixin, PageView):
    """An area of the console whose pages are not built yet: it lists what is coming, plainly."""

    template_name = "area_placeholder.html"
    title = ""
    summary = ""
    coming: tuple[str, ...] = ()

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(title=self.title, summary=self.summary, coming=self.coming)
        return context


def _wants_json(request) -> bool:
    return request.path.startswith("/api/")


def not_found(request, exception=None):
    """Outside any view (an unknown URL): the API's error shape under /api/, a page elsewhere."""
    if _wants_json(request):
        return JsonResponse(error_body("not_found", "No such endpoint or object."), status=404)
    return page_not_found(request, exception)


def server_error(request):
    if _wants_json(request):
        return JsonResponse(error_body("internal_error", "Something went wrong on our side; it has been logged."),
                            status=500)
    return default_server_error(request)
