"""The usage pages' hours and days (``gateway.services.bucket``): on SQLite they are cut from the stored
text rather than by Django's Trunc functions, and must say what those say, at the edges of an hour and a
day and for a time with no fraction of a second (stored without one)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.db.models import Count
from django.db.models.functions import TruncDate, TruncHour

from gateway import services
from gateway.models import UsageRecord

pytestmark = pytest.mark.django_db

TIMES = (datetime(2026, 3, 1, 23, 59, 59, 999999, tzinfo=dt_timezone.utc),
         datetime(2026, 3, 2, 0, 0, 0, tzinfo=dt_timezone.utc),
         datetime(2026, 3, 2, 0, 30, 0, 5, tzinfo=dt_timezone.utc),
         datetime(2026, 3, 2, 13, 0, 0, tzinfo=dt_timezone.utc))


def grouped(expression, read=lambda value: value) -> dict:
    rows = UsageRecord.objects.annotate(b=expression).values("b").annotate(n=Count("id")).order_by("b")
    return {read(row["b"]): row["n"] for row in rows}


@pytest.mark.parametrize(("size", "trunc"), [("hour", TruncHour), ("day", TruncDate)])
def test_buckets_say_what_the_trunc_functions_say(size, trunc):
    for n, at in enumerate(TIMES):
        UsageRecord.objects.create(request_id=f"b{n}", started_at=at, finished_at=at + timedelta(seconds=1),
                                   endpoint="chat/completions", status=200, total_ms=1.0)
    expected = grouped(trunc("started_at"))
    assert len(expected) == (3 if size == "hour" else 2)  # the rows do fall in different buckets
    assert grouped(services.bucket("started_at", size), lambda value: services.bucket_start(value, size)) == expected
