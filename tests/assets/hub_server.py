"""A local stand-in for the Hugging Face hub, for the real ``huggingface_hub`` client.

Serves repositories the tests generate, shaped like the hub's: ``/api/models`` (search),
``/api/models/{repo}[/revision/{rev}]`` (model info with siblings, LFS sha256 and sizes),
``/api/models/{repo}/tree/{rev}`` (file listing), and ``/{repo}/resolve/{rev}/{path}`` (GET and
HEAD with ``X-Repo-Commit``, ``ETag``/``X-Linked-Etag``, ``X-Linked-Size`` and ``Range``).
Loopback only, a free port, one thread per request. Tests can make it lie (serve other bytes than
it advertises), cut a download short once, or go away (``stop``) to look unreachable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


@dataclasses.dataclass
class Commit:
    sha: str
    files: dict[str, bytes]


@dataclasses.dataclass
class Repo:
    repo_id: str
    commits: list[Commit]  # oldest first; "main" is the last
    gated: bool = False
    allowed_tokens: tuple[str, ...] = ()
    tags: list[str] = dataclasses.field(default_factory=list)
    pipeline_tag: str = "text-generation"
    downloads: int = 0
    license: str = "apache-2.0"
    config: dict = dataclasses.field(default_factory=dict)
    lies: dict[str, bytes] = dataclasses.field(default_factory=dict)  # path → bytes served instead
    cut_after: dict[str, int] = dataclasses.field(default_factory=dict)  # path → bytes, once

    def commit(self, revision: str) -> Commit | None:
        if revision in ("main", "HEAD"):
            return self.commits[-1]
        return next((c for c in self.commits if c.sha == revision or c.sha.startswith(revision) and len(revision) >= 7),
                     None)


def is_lfs(path: str, data: bytes) -> bool:
    return not path.endswith((".json", ".md", ".txt")) or len(data) > 10 * 1024


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class HubServer:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[dict] = []  # {method, path, range}
        self.bytes_served: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo_id: str, files: dict[str, bytes], **options) -> Repo:
        """A repository whose first commit holds ``files``; returns it (``add_commit`` for more)."""
        repo = Repo(repo_id=repo_id, commits=[], **options)
        self.repos[repo_id] = repo
        self.add_commit(repo_id, files)
        return repo

    def add_commit(self, repo_id: str, files: dict[str, bytes]) -> str:
        repo = self.repos[repo_id]
        sha = hashlib.sha1(f"{repo_id}:{len(repo.commits)}".encode()).hexdigest()
        repo.commits.append(Commit(sha=sha, files=dict(files)))
        return sha

    def start(self) -> "HubServer":
        server = self

        class Handler(_Handler):
            hub = server

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def ranges(self, path_fragment: str) -> list[str]:
        return [r["range"] for r in self.requests if path_fragment in r["path"] and r["range"]]


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _json(self, body, status: int = 200, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        self._json({"error": message}, status, {"X-Error-Code": code, "X-Error-Message": message})

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        url = urlparse(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        with self.hub._lock:
            self.hub.requests.append({"method": self.command, "path": path, "range": self.headers.get("Range", "")})
        if path == "/api/models":
            return self._search(query)
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
        if match:
            return self._tree(*match.groups())
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if match:
            return self._info(match.group(1), match.group(2) or "main", query)
        match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if match:
            return self._resolve(*match.groups())
        return self._error(404, "EntryNotFound", f"nothing at {path}")

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found")
        return repo

    def _summary(self, repo: Repo) -> dict:
        return {"id": repo.repo_id, "modelId": repo.repo_id, "downloads": repo.downloads, "likes": 0,
                "pipeline_tag": repo.pipeline_tag, "private": False, "gated": "manual" if repo.gated else False,
                "tags": [*repo.tags, f"license:{repo.license}"], "cardData": {"license": repo.license},
                "sha": repo.commits[-1].sha, "lastModified": "2025-01-01T00:00:00.000Z"}

    def _search(self, query) -> None:
        words = (query.get("search") or [""])[0].lower()
        found = [self._summary(r) for r in self.hub.repos.values() if words in r.repo_id.lower()]
        found.sort(key=lambda r: -r["downloads"])
        limit = int((query.get("limit") or ["1000"])[0])
        self._json(found[:limit])

    def _info(self, repo_id: str, revision: str, query) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = repo.commit(revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        body = {**self._summary(repo), "sha": commit.sha, "config": repo.config, "siblings": []}
        for name, data in sorted(commit.files.items()):
            sibling = {"rfilename": name}
            if query.get("blobs"):
                sibling.update(size=len(data), blobId=blob_id(data))
                if is_lfs(name, data):
                    sibling["lfs"] = {"sha256": sha256(data), "size": len(data), "pointerSize": 134}
            body["siblings"].append(sibling)
        self._json(body)

    def _tree(self, repo_id: str, revision: str, prefix: str | None) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = repo.commit(revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        entries = []
        for name, data in sorted(commit.files.items()):
            if prefix and not name.startswith(prefix.rstrip("/") + "/"):
                continue
            entry = {"type": "file", "oid": blob_id(data), "size": len(data), "path": name}
            if is_lfs(name, data):
                entry["lfs"] = {"oid": sha256(data), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        self._json(entries)

    def _resolve(self, repo_id: str, revision: str, name: str) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        if repo.gated:
            auth = self.headers.get("Authorization", "")
            if not any(auth == f"Bearer {t}" for t in repo.allowed_tokens):
                return self._error(403, "GatedRepo", "Access to this gated repository is restricted.")
        commit = repo.commit(revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if name not in commit.files:
            return self._error(404, "EntryNotFound", f"{name} does not exist")
        advertised = commit.files[name]
        data = repo.lies.get(name, advertised)
        etag = sha256(advertised) if is_lfs(name, advertised) else blob_id(advertised)
        headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{etag}"', "X-Linked-Etag": f'"{etag}"',
                   "X-Linked-Size": str(len(advertised)), "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        start, end, status = 0, len(data) - 1, 200
        wanted = self.headers.get("Range")
        if wanted:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted)
            start = int(match.group(1))
            end = min(int(match.group(2)) if match.group(2) else len(data) - 1, len(data) - 1)
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        body = data[start:end + 1]
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        cut = repo.cut_after.pop(name, None) if self.command == "GET" else None
        if cut is not None and cut < len(body):
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self._count(name, cut)
            self.close_connection = True
            import socket

            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)
        self._count(name, len(body))

    def _count(self, name: str, count: int) -> None:
        with self.hub._lock:
            self.hub.bytes_served[name] = self.hub.bytes_served.get(name, 0) + count


# --- fixtures ---------------------------------------------------------------------------------

import pytest  # noqa: E402


@pytest.fixture
def hub(monkeypatch):
    """A running local hub, with ``HF_ENDPOINT`` pointing at it and no token."""
    server = HubServer().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.stop()


@pytest.fixture
def mirror_root(tmp_path, settings):
    """The model root the mirror writes under, private to the test."""
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    settings.SERVING_MIRROR_DISK_MARGIN_BYTES = 0
    return root.resolve()
