"""Serve a hub model in one job: resolve → fetch and verify → servability and estimate → catalog
entry → deployment → a ready replica → a smoke test through the engine. Each step is written to the
job's row as it changes, so the command (or the console) that started it only follows it, and the
job survives the terminal that started it.

The smoke test is one real request as a client would send it: through the gateway
(``settings.SERVING_GATEWAY_URL``: ``BERTH_GATEWAY_INTERNAL_URL``, else the local web server) with
a ten-minute key of a ``serve-model`` client in the model's owner project, revoked once answered —
charged and limited like any of that project's requests. A model with no owner project (shared,
or an organisation's or team's) has no project a key could be charged to: its request goes
straight to the replica, at its node's address as the gateway reaches it, with the engine's key."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import httpx
from django.conf import settings
from django.utils import timezone

from berth.errors import BerthError, InvalidInput
from scheduler.models import Node
from serving.catalog import fetch, profiles, servability
from serving.control import placement, routing
from serving.deployments import service
from serving.keys import replica_key
from serving.models import Deployment, DeploymentState as S, FetchJob
from serving.models.states import SERVING, TERMINAL
from tenancy import access
from tenancy.audit import Actor
from tenancy.models import Credential, Scope, ServiceClient
from tenancy.services import clients
from tenancy.services.tree import resolve_scope

log = logging.getLogger(__name__)
STEPS = ("resolve", "fetch", "check", "catalog", "deploy", "wait", "smoke")
READY_TIMEOUT_SECONDS = 30 * 60
SMOKE_CLIENT = "serve-model"  # the owner project's client the smoke request is sent as
SMOKE_KEY_LIFETIME = timedelta(minutes=10)  # and revoked as soon as the request is answered
SMOKE_ACTOR = Actor(system="serve_model")


def start(actor: Actor, request: fetch.FetchRequest, *, on_demand: bool = False, node: str = "",
          context: int = 4096, enqueue: bool = True) -> FetchJob:
    job = fetch.start(actor, request, kind=FetchJob.Kind.SERVE, enqueue=enqueue,
                      options={"on_demand": on_demand, "node": node, "context": context,
                               "scaling_min": 0 if on_demand else 1, "scaling_max": 1})
    files = ", ".join(f["path"] for f in job.files)
    job.steps = [{"name": name, "state": "waiting", "detail": "", "at": None} for name in STEPS]
    job.steps[0].update(state="done", detail=f"{job.repo} @ {job.commit[:8]}: {files}", at=_now())
    FetchJob.objects.filter(pk=job.pk).update(steps=job.steps)
    return job


def _now() -> str:
    return timezone.now().isoformat()


def _step(job: FetchJob, name: str, state: str, detail: str = "") -> None:
    for step in job.steps:
        if step["name"] == name:
            step.update(state=state, detail=detail, at=_now())
    FetchJob.objects.filter(pk=job.pk).update(steps=job.steps)


def _fail(job: FetchJob, name: str, reason: str) -> FetchJob:
    _step(job, name, "failed", reason)
    FetchJob.objects.filter(pk=job.pk).update(status=FetchJob.Status.FAILED, error=reason, finished_at=timezone.now())
    job.refresh_from_db()
    return job


def run(job: FetchJob) -> FetchJob:
    _step(job, "fetch", "running")
    fetched = fetch.run(job)
    job.refresh_from_db()
    if fetched.status != FetchJob.Status.DONE:
        return _fail(job, "fetch", fetched.error or "the fetch did not finish")
    verified = sum(f["state"] == "verified" for f in job.files)
    _step(job, "fetch", "done", f"{verified} file(s) verified, {job.total_bytes:,} bytes")
    FetchJob.objects.filter(pk=job.pk).update(status=FetchJob.Status.RUNNING, finished_at=None)
    entry = job.model
    try:
        verdict = servability.check_entry(entry)
    except BerthError as error:
        return _fail(job, "check", error.message)
    context = profiles.first(entry).get("context") or profiles.DEFAULT_CONTEXT
    if not verdict.servable:
        return _fail(job, "check", verdict.reason)
    estimate = verdict.estimate["total_bytes"] if verdict.estimate else None
    _step(job, "check", "done", f"{verdict.engine} loads {verdict.architecture}" +
          (f"; about {estimate / 2**20:,.0f} MiB at {context} tokens" if estimate else ""))
    _step(job, "catalog", "done", f"{entry.name} (fingerprint {entry.fingerprint})")
    if job.options.get("on_demand"):
        for name in ("deploy", "wait", "smoke"):
            _step(job, name, "skipped", "on demand: no replica until a request asks for it")
        return _done(job, {"model": entry.name})
    nodes = Node.objects.all()
    node = nodes.filter(name=job.options.get("node")).first() if job.options.get("node") else nodes.first()
    if node is None:
        return _fail(job, "deploy", "No node is registered to run it on.")
    actor = Actor(user=job.created_by, system="serve_model")
    # The placement loop may already have launched it (the entry wants a replica): wait for that one.
    running = Deployment.objects.filter(name=entry.name, state__in=SERVING).first()
    try:
        deployment = running or service.deploy(actor, placement.deploy_request(entry, node))
    except BerthError as error:
        return _fail(job, "deploy", error.message)
    _step(job, "deploy", "done", f"{deployment.name} on {node.name}")
    _step(job, "wait", "running")
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while True:
        deployment.refresh_from_db()
        if deployment.state == S.READY:
            break
        if deployment.state in TERMINAL or time.monotonic() > deadline:
            last = deployment.events.order_by("-at").first()
            return _fail(job, "wait", f"{deployment.name} is {deployment.state}: "
                                      f"{(last.message if last else '') or deployment.state_detail}")
        time.sleep(1)
    replica = deployment.replica_set.filter(state=S.READY).first()
    _step(job, "wait", "done", f"replica on {replica.node.name}:{replica.port} ready")
    try:
        answer, rate, via = smoke_test(replica, actor)
    except (httpx.HTTPError, KeyError, ValueError, TypeError) as error:
        return _fail(job, "smoke", f"No answer: {error}")
    _step(job, "smoke", "done", f"{answer!r} at {rate:.1f} tokens/s, through {via}")
    return _done(job, {"model": entry.name, "deployment": str(deployment.public_id), "answer": answer,
                       "tokens_per_second": round(rate, 2), "smoke_via": via})


def smoke_test(replica, actor: Actor = SMOKE_ACTOR) -> tuple[str, float, str]:
    """One real chat request to ``replica``'s model: (its answer, tokens per second, where it went —
    the gateway's URL, or the replica's own). Through the gateway with a short-lived key of the
    owner project's ``serve-model`` client, minted as ``actor`` (audited) and revoked once answered;
    straight to the replica when there is no such key (see the module's docstring)."""
    deployment = replica.deployment
    key = _gateway_key(actor, deployment.owner)
    if key is not None:
        credential, plaintext = key
        base = settings.SERVING_GATEWAY_URL.rstrip("/")
        try:
            return (*_ask(base, plaintext, deployment.name), base)
        finally:
            try:
                clients.revoke_credential(actor, credential)
            except BerthError as error:  # it expires in minutes anyway; the answer still counts
                log.warning("could not revoke the smoke test's key %s: %s", credential.prefix, error.message)
    base = _replica_url(replica)
    return (*_ask(base, replica_key(replica.public_id), deployment.name), base)


def _gateway_key(actor: Actor, owner: Scope | None) -> tuple[Credential, str] | None:
    """A fresh key for the smoke request, or None when the model has no owner project or ``actor``
    may not use it (the request then goes to the replica, as before there was a gateway)."""
    if owner is None or owner.kind != Scope.Kind.PROJECT:
        return None
    try:
        client = ServiceClient.objects.filter(project=owner, name=SMOKE_CLIENT).first() or clients.create_client(
            actor, owner, SMOKE_CLIENT, all_models=True,
            description="serve_model's smoke tests: one request per served model, through the gateway.")
        return clients.create_credential(actor, client, name="smoke", lifetime=SMOKE_KEY_LIFETIME)
    except BerthError as error:
        log.info("smoke test of a model of %s goes to the replica, not the gateway: %s", owner.path, error.message)
        return None


def _replica_url(replica) -> str:
    """The replica's address as the gateway reaches it — its node's address and its port, the URL
    the routing table lists for it — not the control plane's loopback."""
    route = routing.load_table().route(replica.deployment.name)
    found = [e.url for e in (route.endpoints if route else ()) if e.replica_id == str(replica.public_id)]
    if not found:
        raise ValueError(f"replica {replica.public_id} is not ready in the routing table")
    return found[0]


def _ask(base: str, key: str, model: str) -> tuple[str, float]:
    started = time.monotonic()
    response = httpx.post(f"{base}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {key}"},
                          json={"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                                "max_tokens": 16})
    response.raise_for_status()
    body = response.json()
    elapsed = time.monotonic() - started
    tokens = body["usage"]["completion_tokens"]
    return body["choices"][0]["message"]["content"], tokens / elapsed if elapsed else 0.0


def _done(job: FetchJob, result: dict) -> FetchJob:
    FetchJob.objects.filter(pk=job.pk).update(status=FetchJob.Status.DONE, result=result, finished_at=timezone.now())
    job.refresh_from_db()
    return job


def start_from_values(actor: Actor, caller, values: dict) -> FetchJob:
    """Start a serve-in-one-command job from form or API values (refused up front with the reason);
    an owner is resolved among the scopes ``caller`` may see."""
    owner = None
    if values.get("owner"):
        owner = resolve_scope(values["owner"], access.visible_to(caller, Scope.objects.all(), ""))
    try:
        context = int(values.get("context") or profiles.DEFAULT_CONTEXT)
    except (TypeError, ValueError):
        raise InvalidInput("Context is a whole number of tokens.", details={"context": values.get("context")})
    return start(actor, fetch.FetchRequest(
        repo=values.get("repo") or "", revision=values.get("revision") or "main", quant=values.get("quant") or None,
        file=values.get("file") or None, name=values.get("name") or None, owner=owner),
        on_demand=bool(values.get("on_demand")), node=values.get("node") or "", context=context)
