"""Filters every app's FilterSets share."""

from __future__ import annotations

from datetime import timezone

import django_filters
from django import forms
from django_filters.fields import IsoDateTimeField


class UtcDateTimeField(IsoDateTimeField):
    """An ISO 8601 date-time, given to the database in UTC: Python accepts offsets up to ±23:59 that
    PostgreSQL refuses (it was a server error). A moment near year 1 or 9999 that does not exist in
    UTC at all is the caller's mistake, said so."""

    def to_python(self, value):
        try:
            moment = super().to_python(value)
            return moment.astimezone(timezone.utc) if moment is not None and moment.tzinfo is not None else moment
        except OverflowError:
            raise forms.ValidationError("That moment lies outside the years 1 to 9999 in UTC.",
                                        code="invalid") from None


class DateTimeFilter(django_filters.IsoDateTimeFilter):
    """``?since=`` / ``?until=`` and the like: an ISO 8601 date-time, compared in UTC."""

    field_class = UtcDateTimeField
