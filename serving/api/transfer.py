"""``GET /api/serving/mirror/files/<id>/content/``: a file of the mirror, to a node holding a link
for it (``serving.catalog.transfer``). ``Range: bytes=N-`` answers the rest from byte N (206), so a
transfer that broke resumes. Not a DRF view: a node's link is its only credential here, and the
answer is the file's bytes, not JSON."""

from __future__ import annotations

import re
from pathlib import Path

from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.views import View

from berth.errors import BerthError, InvalidInput, PermissionDenied
from serving.catalog import transfer

RANGE = re.compile(r"^bytes=(\d+)-$")


def _refused(error: BerthError) -> JsonResponse:
    return JsonResponse({"error": error.as_dict()}, status=error.status)


class WeightsContentView(View):
    http_method_names = ["get", "head"]

    def get(self, request, public_id):
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        try:
            if not token:
                raise PermissionDenied("A node fetches weights with the link it was given (Authorization: Bearer …).")
            transfer.node_of(token, str(public_id))
            file = transfer.servable(public_id)
            size = Path(file.path).stat().st_size
            start = 0
            asked = request.headers.get("Range", "")
            if asked:
                found = RANGE.match(asked.strip())
                if found is None:
                    raise InvalidInput("Only one open range is served: Range: bytes=N-.", code="invalid_range")
                start = int(found.group(1))
        except BerthError as error:
            return _refused(error)
        if start >= size and size:
            answer = HttpResponse(status=416)
            answer["Content-Range"] = f"bytes */{size}"
            return answer
        answer = StreamingHttpResponse(transfer.read_from(Path(file.path), start), status=206 if start else 200,
                                       content_type="application/octet-stream")
        answer["Content-Length"] = str(size - start)
        answer["Accept-Ranges"] = "bytes"
        answer["X-Checksum-SHA256"] = file.expected_sha256 or file.sha256
        if start:
            answer["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        return answer
