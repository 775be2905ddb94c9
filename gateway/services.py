"""The gateway app's verbs for the console, the API and commands: usage as the caller may see it."""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Q, Sum
from django.db.models.functions import Substr, TruncDate, TruncHour
from django.utils import timezone

from berth.errors import InvalidInput
from gateway import charts as draw
from gateway.batch import service as batch_service
from gateway.models import Batch, ModelSplit, UsageRecord
from gateway.usage import retry_parked
from serving import events
from serving.models import Deployment, ModelEntry
from tenancy import access, audit
from tenancy.errors import Forbidden


def visible_usage(caller, queryset=None):
    """Usage records (of ``queryset``, default all) of the scopes where ``caller`` holds a role
    (everything for a superuser). Narrowed by the record's own ``scope_path``, so no join and no row
    of another tenancy."""
    return access.visible_by_path(caller, UsageRecord.objects.all() if queryset is None else queryset, "scope_path")


def visible_batches(caller, queryset=None):
    """Batches (of ``queryset``, default all) of the scopes where ``caller`` holds a role: the rule of
    ``visible_usage``, by the ``scope_path`` a batch keeps of its client's project."""
    queryset = Batch.objects.select_related("client__project", "credential") if queryset is None else queryset
    return access.visible_by_path(caller, queryset, "scope_path")


def may_cancel_batch(caller, batch) -> bool:
    """Cancelling is operating the batch's client: a member (or above) of its project, as for its keys."""
    return access.can(caller, "use", batch.client)


def cancel_batch(actor, batch) -> Batch:
    """Cancel ``batch`` for a person or a management client (the console, ``/api/gateway/batches/``):
    "use" on its client's project, else 404 (out of reach) or 403; an ended batch is ``batch_ended``
    (409). The key holder's own cancel under /v1/ is ``gateway.batch.service.cancel``, which this calls
    (and so refuses the same way) with the audit event in the same transaction."""
    access.require(actor, "use", batch.client)
    client = batch.client
    with transaction.atomic():
        was = Batch.objects.select_for_update().values_list("status", flat=True).get(pk=batch.pk)
        batch = batch_service.cancel(batch)
        if was != Batch.Status.CANCELLING:  # asked again while it winds down: nothing changed, nothing to log
            audit.record(actor, "batch.cancel", batch, scope=client.project,
                         details={"was": was, "endpoint": batch.endpoint, "client": str(client.public_id)})
    batch.client = client
    return batch


def bucket(field: str, size: str):
    """``field`` cut to its hour or its day (``size``: "hour" or "day"), to group by; ``bucket_start``
    reads the value back. On SQLite, Django's TruncHour and TruncDate call a Python function for every
    row (40 ms over 10,000 usage rows, ``manage.py bench_console``); the text SQLite stores
    (``YYYY-MM-DD HH:MM:SS.ffffff``, in UTC, Berth's one time zone) starts with both, so its first
    characters are grouped instead (4 ms)."""
    if connection.vendor == "sqlite" and settings.TIME_ZONE == "UTC":
        return Substr(field, 1, 13 if size == "hour" else 10)
    return TruncHour(field) if size == "hour" else TruncDate(field)


def bucket_start(value, size: str):
    """What ``bucket`` grouped by, as the Trunc functions give it: the hour (aware, UTC) or the date."""
    if not isinstance(value, str):
        return value
    if size == "hour":
        return datetime.strptime(value, "%Y-%m-%d %H").replace(tzinfo=dt_timezone.utc)
    return date.fromisoformat(value)


def totals_by_model_and_day(queryset, days: int = 14) -> list[dict]:
    since = timezone.now() - timedelta(days=days)
    rows = (queryset.filter(started_at__gte=since)
            .annotate(day=bucket("started_at", "day"))
            .values("day", "model_served")
            .annotate(requests=Count("id"), prompt_tokens=Sum("prompt_tokens"),
                      completion_tokens=Sum("completion_tokens"), cost=Sum("cost"))
            .order_by("-day", "model_served"))
    return [{**row, "day": bucket_start(row["day"], "day")} for row in rows]


def retry_parked_usage() -> int:
    """Write usage batches the database refused earlier (parked on Redis)."""
    from django.conf import settings

    return retry_parked(settings.REDIS_URL)


# -- model splits (canaries and experiments) -------------------------------------------------------

ENVIRONMENTS = ("production", "staging", "development")


def known_model_names() -> set[str]:
    """Names a request may route to: catalog names and aliases, and deployments' names."""
    names = set(Deployment.objects.values_list("name", flat=True).distinct())
    for name, aliases in ModelEntry.objects.values_list("name", "aliases"):
        names.add(name)
        names.update(aliases or ())
    return names


def clean_split(model_name: str, variants, environments) -> tuple[str, list[dict], list[str]]:
    """Validate a split's fields; returns them normalised. Raises ``InvalidInput`` naming the field."""
    model_name = (model_name or "").strip()
    if not model_name or len(model_name) > 200:
        raise InvalidInput("A split needs the model name it answers to (up to 200 characters).",
                           details={"model_name": "required"})
    if not isinstance(variants, list):
        raise InvalidInput("`variants` is a list of {model, weight}.", details={"variants": "list"})
    if not isinstance(environments, list) or any(e not in ENVIRONMENTS for e in environments):
        raise InvalidInput(f"`environments` is a list of {', '.join(ENVIRONMENTS)} (empty: any).",
                           details={"environments": list(ENVIRONMENTS)})
    cleaned, seen = [], set()
    known = known_model_names() if variants else set()
    for position, variant in enumerate(variants):
        if not isinstance(variant, dict):
            raise InvalidInput("Each variant is {model, weight}.", details={"variants": position})
        name = str(variant.get("model") or "").strip()
        weight = variant.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int) or weight <= 0:
            raise InvalidInput(f"Variant {name or position}: the weight must be a positive whole number.",
                               details={"variants": position, "weight": weight})
        if name == model_name:
            raise InvalidInput(f"A split of {model_name} cannot name {model_name} itself as a variant.",
                               details={"variants": position, "model": name})
        if name in seen:
            raise InvalidInput(f"{name} is named twice.", details={"variants": position, "model": name})
        if name not in known:
            raise InvalidInput(f"No model is called {name!r} (not in the catalog, no deployment).",
                               details={"variants": position, "model": name})
        seen.add(name)
        cleaned.append({"model": name, "weight": weight})
    if not cleaned and not environments:
        raise InvalidInput("A split needs variants, allowed environments, or both.",
                           details={"variants": "required"})
    return model_name, cleaned, sorted(set(environments), key=ENVIRONMENTS.index)


def may_manage_split(caller, scope) -> bool:
    """Staff manage every split; a scope's admins manage the splits of that scope (and below)."""
    user = getattr(caller, "user", caller)
    if access.is_superuser(caller) or getattr(user, "is_staff", False) and getattr(user, "is_active", False):
        return True
    return scope is not None and access.can(caller, "change", scope)


def visible_splits(caller, queryset=None):
    """Fleet-wide splits (they apply to everyone) and the splits of scopes the caller can see (of
    ``queryset``, default all)."""
    queryset = ModelSplit.objects.select_related("scope") if queryset is None else queryset
    user = getattr(caller, "user", caller)
    if access.is_superuser(caller) or getattr(user, "is_staff", False):
        return queryset
    scoped = access.visible_to(caller, queryset.filter(scope__isnull=False), "scope")
    return queryset.filter(Q(scope__isnull=True) | Q(pk__in=scoped.values("pk")))


def _changed() -> None:
    from django.db import transaction

    transaction.on_commit(events.routing_changed)  # every gateway process reloads its table now


def save_split(caller, split, *, model_name: str, scope, variants, environments, enabled: bool = True,
               note: str = ""):
    """Create (``split`` None) or change a split, checked and validated; routing follows at once."""
    from django.db import IntegrityError, transaction

    for where in ([scope] if split is None else [split.scope, scope]):
        if not may_manage_split(caller, where):
            raise Forbidden("Only staff manage fleet-wide splits; a scope's splits need an admin of the scope.",
                            details={"scope": where.path if where is not None else None})
    model_name, variants, environments = clean_split(model_name, variants, environments)
    split = split or ModelSplit()
    split.model_name, split.scope, split.variants, split.environments = model_name, scope, variants, environments
    split.enabled, split.note = bool(enabled), (note or "")[:200]
    try:
        with transaction.atomic():
            split.save()
    except IntegrityError:
        raise InvalidInput(f"{model_name} already has a split in this scope.",
                           details={"model_name": model_name}) from None
    _changed()
    return split


def delete_split(caller, split) -> None:
    if not may_manage_split(caller, split.scope):
        raise Forbidden("Only staff or an admin of the split's scope may remove it.")
    split.delete()
    _changed()


# -- charts: one aggregate query each ------------------------------------------------------------

def per_day(queryset, days: int = 14) -> list[dict]:
    """Requests and tokens per UTC day (one query)."""
    since = timezone.now() - timedelta(days=days)
    rows = (queryset.filter(started_at__gte=since).annotate(day=bucket("started_at", "day")).values("day")
            .annotate(requests=Count("id"), prompt_tokens=Sum("prompt_tokens"),
                      completion_tokens=Sum("completion_tokens")).order_by("day"))
    return [{**row, "day": bucket_start(row["day"], "day")} for row in rows]


def per_day_of(totals: list[dict]) -> list[dict]:
    """``per_day``'s rows summed from ``totals_by_model_and_day``'s of the same records and period,
    for a page that shows both: the records are read once."""
    days: dict = {}
    for row in totals:
        into = days.setdefault(row["day"], {"day": row["day"], "requests": 0, "prompt_tokens": None,
                                            "completion_tokens": None})
        into["requests"] += row["requests"]
        for key in ("prompt_tokens", "completion_tokens"):  # None while no record says (a Sum of none)
            if row[key] is not None:
                into[key] = (into[key] or 0) + row[key]
    return [days[day] for day in sorted(days)]


def latency_by_model(queryset, days: int = 14) -> list[dict]:
    """p50/p95/p99 of total time per model served (one query; PostgreSQL computes the percentiles,
    other databases get the times of the period in one query and sort here)."""
    from django.db import connection
    from django.db.models import Aggregate, FloatField

    since = timezone.now() - timedelta(days=days)
    rows = queryset.filter(started_at__gte=since).exclude(model_served="")
    if connection.vendor == "postgresql":
        class Percentile(Aggregate):
            function = "PERCENTILE_CONT"
            template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
            output_field = FloatField()

            def __init__(self, expression, fraction, **extra):
                super().__init__(expression, fraction=float(fraction), **extra)

        return list(rows.values("model_served").annotate(
            requests=Count("id"), p50=Percentile("total_ms", 0.5), p95=Percentile("total_ms", 0.95),
            p99=Percentile("total_ms", 0.99)).order_by("model_served"))
    times: dict[str, list[float]] = {}
    for model, total in rows.values_list("model_served", "total_ms").iterator():
        times.setdefault(model, []).append(total)
    out = []
    for model in sorted(times):
        values = sorted(times[model])

        def at(fraction, values=values):
            position = fraction * (len(values) - 1)
            low = int(position)
            high = min(low + 1, len(values) - 1)
            return values[low] + (values[high] - values[low]) * (position - low)

        out.append({"model_served": model, "requests": len(values), "p50": at(0.5), "p95": at(0.95),
                    "p99": at(0.99)})
    return out


def charts(queryset, days: int = 14, totals: list[dict] | None = None) -> dict:
    """The console's three charts (two queries; one where ``totals``, ``totals_by_model_and_day``'s
    rows of the same records and period, give the days)."""
    daily = per_day(queryset, days) if totals is None else per_day_of(totals)
    labels = [row["day"].strftime("%m-%d") for row in daily]
    latency = latency_by_model(queryset, days)
    return {
        "requests": draw.stacked_bars("Requests per day", labels, {"requests": [row["requests"] for row in daily]})
        if daily else "",
        "tokens": draw.stacked_bars("Tokens per day", labels,
                                    {"prompt": [row["prompt_tokens"] or 0 for row in daily],
                                     "completion": [row["completion_tokens"] or 0 for row in daily]})
        if daily else "",
        "latency": draw.grouped_hbars("Latency percentiles per model (total ms)",
                                      [row["model_served"] for row in latency],
                                      {"p50": [row["p50"] or 0 for row in latency],
                                       "p95": [row["p95"] or 0 for row in latency],
                                       "p99": [row["p99"] or 0 for row in latency]}) if latency else "",
    }
