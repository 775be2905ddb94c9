"""vLLM's sleep/wake HTTP contract served on loopback, for tests that cannot run vLLM (no GPU)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class ContractServer:
    """vLLM's sleep/wake endpoints on 127.0.0.1, recording every call."""

    def __init__(self, sleep_mode: bool = True):
        self.calls: list[dict] = []
        self.sleeping = False
        self.sleep_mode = sleep_mode
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: dict | None = None):
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self):
                url = urlparse(self.path)
                server.calls.append({"method": self.command, "path": url.path, "query": parse_qs(url.query),
                                     "authorization": self.headers.get("Authorization")})
                return url.path

            def do_POST(self):
                path = self._record()
                if not server.sleep_mode:
                    return self._answer(404, {"detail": "Not Found"})
                if path == "/sleep":
                    server.sleeping = True
                    return self._answer(200)
                if path == "/wake_up":
                    server.sleeping = False
                    return self._answer(200)
                return self._answer(404, {"detail": "Not Found"})

            def do_GET(self):
                path = self._record()
                if path == "/is_sleeping" and server.sleep_mode:
                    return self._answer(200, {"is_sleeping": server.sleeping})
                return self._answer(404, {"detail": "Not Found"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
