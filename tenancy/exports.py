"""The audit log as a file, in one schema for every transport: the console's download and the API's
export write the same lines, each event as the API's list shows it (``AuditEventSerializer``), oldest
first, streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator

from django.http import StreamingHttpResponse
from django.utils import timezone

from tenancy.api.serializers import AuditEventSerializer

MEDIA_TYPE = "application/x-ndjson"


def audit_lines(events) -> Iterator[str]:
    """One JSON object a line for each event of ``events`` (already narrowed and filtered)."""
    for event in events.order_by("at", "id").iterator(chunk_size=500):
        yield json.dumps(AuditEventSerializer(event).data, default=str, ensure_ascii=False) + "\n"


def audit_export(events) -> StreamingHttpResponse:
    """The download of ``events`` as JSON lines."""
    response = StreamingHttpResponse(audit_lines(events), content_type=MEDIA_TYPE)
    response["Content-Disposition"] = f'attachment; filename="berth-audit-{timezone.now():%Y%m%d-%H%M%S}.jsonl"'
    return response
