"""The gateway app's verbs for the console, the API and commands: usage as the caller may see it."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from gateway.models import UsageRecord
from tenancy import access


def visible_usage(caller):
    """Usage records of the scopes where ``caller`` holds a role (everything for a superuser). Narrowed
    by the record's own ``scope_path``, so no join and no row of another tenancy."""
    queryset = UsageRecord.objects.all()
    if access.is_superuser(caller):
        return queryset
    grants = access.roles(caller)
    if not grants:
        return queryset.none()
    condition = Q()
    for path in grants:
        condition |= Q(scope_path=path) | Q(scope_path__startswith=path + "/")
    return queryset.filter(condition)


def totals_by_model_and_day(queryset, days: int = 14) -> list[dict]:
    since = timezone.now() - timedelta(days=days)
    return list(queryset.filter(started_at__gte=since)
                .annotate(day=TruncDate("started_at"))
                .values("day", "model_served")
                .annotate(requests=Count("id"), prompt_tokens=Sum("prompt_tokens"),
                          completion_tokens=Sum("completion_tokens"), cost=Sum("cost"))
                .order_by("-day", "model_served"))


def retry_parked_usage() -> int:
    """Write usage batches the database refused earlier (parked on Redis)."""
    from django.conf import settings

    from gateway.usage import retry_parked

    return retry_parked(settings.REDIS_URL)
