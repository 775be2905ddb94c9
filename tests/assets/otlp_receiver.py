"""A trace collector's OTLP/HTTP endpoint on loopback, for tests: it keeps what it is sent (JSON
bodies and their headers) and answers ``status`` (200 unless a test makes it refuse)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class OtlpReceiver:
    def __init__(self):
        self.posts: list[tuple[dict, dict]] = []  # (headers, body)
        self.status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if receiver.status < 300:
                    receiver.posts.append(({k.lower(): v for k, v in self.headers.items()}, json.loads(body)))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[dict]:
        """Every span received, each with its resource's ``service.name`` added as ``_service``."""
        found = []
        for _, body in list(self.posts):
            for resource in body["resourceSpans"]:
                service = next(a["value"]["stringValue"] for a in resource["resource"]["attributes"]
                               if a["key"] == "service.name")
                for scope in resource["scopeSpans"]:
                    found += [dict(span, _service=service) for span in scope["spans"]]
        return found

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
