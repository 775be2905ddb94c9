"""A node's agent played in the test's own process, one job at a time: the node API's real views
(authentication, serializers, handlers) reached through Django's test client, and the agent's own
halves (``serving.node.lifecycle``, ``serving.node.heartbeat``) doing the node's part. For tests that
need an exact order of events — a stop landing while a start launches — that a separate agent
process cannot give."""

from __future__ import annotations

import json

from django.test import Client

from scheduler import enrolment
from serving.node import lifecycle
from serving.node.client import NodeApiError
from serving.node.heartbeat import Heartbeat
from tenancy.audit import Actor


class InlineClient:
    """``NodeClient``'s calls, in this process. ``server``: where weights are fetched from (a live
    server, for the tests that move weights)."""

    def __init__(self, node, server: str = "http://testserver"):
        self.node = node
        self.server = server.rstrip("/")
        self.verify = True
        self._credential = enrolment.issue_credential(Actor(system="tests"), node)
        self._http = Client()
        self.heartbeat = Heartbeat(self, node.name)  # one for the client's life: it keeps what was expected

    def post(self, path: str, body: dict | None = None, *, timeout: float | None = None) -> dict | None:
        answer = self._http.post(f"/api/node/{path}", data=json.dumps(body or {}), content_type="application/json",
                                 HTTP_AUTHORIZATION=f"Bearer {self._credential}")
        if answer.status_code >= 400:
            error = answer.json().get("error", {})
            raise NodeApiError(answer.status_code, error.get("code", ""), error.get("message", ""),
                               details=error.get("details") or {})
        return None if answer.status_code == 204 else answer.json()


def claim(client: InlineClient) -> lifecycle.Job | None:
    """The node's next job, leased, or None when none is claimable now."""
    data = client.post("jobs/claim/", {"wait": 0})
    return lifecycle.Job(client, data["job"]) if data else None


def run_next(client: InlineClient, kind: str | None = None) -> lifecycle.Job | None:
    """Claim the node's next job (of ``kind``, when given: it must be the next) and do it."""
    job = claim(client)
    if job is None:
        return None
    assert kind is None or job.kind == kind, f"the next job is a {job.kind}, not a {kind}"
    lifecycle.run(job, client.node.name)
    return job


def run_all(client: InlineClient) -> list[lifecycle.Job]:
    """Every claimable job of the node, in the order handed out, until none is left."""
    done = []
    while (job := run_next(client)) is not None:
        done.append(job)
    return done


def beat(client: InlineClient, *, first: bool = False) -> dict:
    """One heartbeat of the node, as its agent sends it (the engines it reports include those the
    previous beat's answer expected)."""
    return client.heartbeat.send(first=first)
