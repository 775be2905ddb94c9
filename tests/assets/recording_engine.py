"""A loopback HTTP hop in front of a real engine, for tests that compare what the gateway sent with
what the engine answered (headers included)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class RecordingEngine:
    """A loopback HTTP hop in front of a real engine that keeps what the gateway sent it and what the
    engine answered, so a test can compare both ends. A path in ``missing`` is answered as an engine
    without that route answers (FastAPI's 404)."""

    def __init__(self, upstream: str, missing: tuple[str, ...] = ()):
        self.calls: list[dict] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                sent = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path in missing:
                    status, answer = 404, b'{"detail":"Not Found"}'
                else:
                    reply = httpx.post(upstream + self.path, content=sent, timeout=120,
                                       headers={"Authorization": self.headers["Authorization"],
                                                "Content-Type": "application/json"})
                    status, answer = reply.status_code, reply.content
                recorder.calls.append({"path": self.path, "body": json.loads(sent), "status": status,
                                       "answer": answer, "headers": {k.lower(): v for k, v in self.headers.items()}})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def last(self, path: str) -> dict:
        return [call for call in self.calls if call["path"] == path][-1]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
