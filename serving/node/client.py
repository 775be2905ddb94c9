"""The agent's side of the node API: the one way a node reaches the control plane. It holds the
server's URL and this node's own credential, nothing else: no database, broker or cluster secret.

Over https the server's certificate is verified (against ``ca_file`` when given). A request the
server answers with an error raises ``NodeApiError`` with the server's code; one that never got an
answer (the server restarting, the network away) raises ``ServerUnreachable``, which the agent's
loops ride through, retrying.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import httpx

from berth.errors import BerthError

CREDENTIAL_MODE = 0o600
# What an agent is never given: the node API is its only way in (``manage.py serve`` and the tests
# start this machine's agent without them).
CLUSTER_SETTINGS = ("DATABASE_URL", "REDIS_URL", "BERTH_SECRET_KEY", "BERTH_KEY_PEPPER")


class ServerUnreachable(Exception):
    """No answer from the control plane (refused, reset, timed out)."""


class NodeApiError(BerthError):
    """The control plane refused a request; ``code`` is its own (``node_revoked``, ``node_lease_stale``…)."""

    def __init__(self, status: int, code: str, message: str, details: dict | None = None):
        super().__init__(message, code=code, status=status, details=details)


@dataclasses.dataclass(frozen=True)
class Credential:
    """What a node keeps (its credential file, mode 0600): the server, its name, its credential."""

    server: str
    node: str
    credential: str

    def save(self, path: Path) -> None:
        """Write it readable by this user alone, replacing any earlier one in one step."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, CREDENTIAL_MODE)
        with os.fdopen(descriptor, "w") as out:
            json.dump(dataclasses.asdict(self), out)
        os.chmod(partial, CREDENTIAL_MODE)
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path) -> Credential:
        data = json.loads(path.read_text())
        return cls(server=str(data.get("server") or ""), node=str(data["node"]), credential=str(data["credential"]))


def _verify(ca_file: str | None):
    return ca_file if ca_file else True


def _raise_for(answer: httpx.Response) -> None:
    if answer.status_code < 400:
        return
    try:
        body = answer.json()
    except ValueError:
        body = {}
    error = body.get("error") if isinstance(body.get("error"), dict) else body
    raise NodeApiError(answer.status_code, str(error.get("code") or f"http_{answer.status_code}"),
                       str(error.get("message") or answer.text[:300]), details=error.get("details") or {})


def enrol(server: str, token: str, *, name: str, address: str, ca_file: str | None = None) -> Credential:
    """Exchange a one-time enrolment token for this node's own credential."""
    try:
        answer = httpx.post(f"{server.rstrip('/')}/api/node/enrol/", json={"token": token, "name": name,
                                                                           "address": address},
                            verify=_verify(ca_file), timeout=30)
    except httpx.HTTPError as error:
        raise ServerUnreachable(f"{server} did not answer the enrolment ({error})") from error
    _raise_for(answer)
    body = answer.json()
    return Credential(server=server.rstrip("/"), node=body["node"]["name"], credential=body["credential"])


class NodeClient:
    """Authenticated calls to ``/api/node/`` as one node. Thread-safe (one connection pool)."""

    def __init__(self, credential: Credential, *, ca_file: str | None = None):
        self.credential = credential
        self.server = credential.server
        self.verify = _verify(ca_file)  # for the agent's other calls to the server (weights)
        self._http = httpx.Client(base_url=f"{credential.server}/api/node/", verify=self.verify,
                                  headers={"Authorization": f"Bearer {credential.credential}"},
                                  timeout=httpx.Timeout(30, connect=5))

    def post(self, path: str, body: dict | None = None, *, timeout: float | None = None) -> dict | None:
        """POST ``body`` to ``path``; the answer's JSON, or None for 204 (nothing to say)."""
        try:
            answer = self._http.post(path, json=body or {}, **({"timeout": timeout} if timeout else {}))
        except httpx.HTTPError as error:
            raise ServerUnreachable(f"{self.credential.server} did not answer {path} ({error})") from error
        _raise_for(answer)
        return None if answer.status_code == 204 or not answer.content else answer.json()

    def get(self, path: str) -> dict:
        try:
            answer = self._http.get(path)
        except httpx.HTTPError as error:
            raise ServerUnreachable(f"{self.credential.server} did not answer {path} ({error})") from error
        _raise_for(answer)
        return answer.json()

    def close(self) -> None:
        self._http.close()
