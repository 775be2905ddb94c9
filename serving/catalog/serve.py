"""Serve a hub model in one job: resolve → fetch and verify → servability and estimate → catalog
entry → deployment → a ready replica → a smoke test through the engine. Each step is written to the
job's row as it changes, so the command (or the console) that started it only follows it, and the
job survives the terminal that started it."""

from __future__ import annotations

import time

import httpx
from django.utils import timezone

from berth.errors import BerthError
from serving.catalog import entries, fetch, profiles, servability
from serving.catalog.models import FetchJob
from tenancy.audit import Actor

STEPS = ("resolve", "fetch", "check", "catalog", "deploy", "wait", "smoke")
READY_TIMEOUT_SECONDS = 30 * 60


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
    from scheduler.models import Node
    from serving.deployments import service, states
    from serving.models import Deployment

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
    running = Deployment.objects.filter(name=entry.name, state__in=states.ACTIVE + ("planned",)).first()
    try:
        deployment = running or service.deploy(actor, entries.deploy_request(entry, node))
    except BerthError as error:
        return _fail(job, "deploy", error.message)
    _step(job, "deploy", "done", f"{deployment.name} on {node.name}")
    _step(job, "wait", "running")
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while True:
        deployment.refresh_from_db()
        if deployment.state == "ready":
            break
        if deployment.state in ("failed", "stopped") or time.monotonic() > deadline:
            last = deployment.events.order_by("-at").first()
            return _fail(job, "wait", f"{deployment.name} is {deployment.state}: "
                                      f"{(last.message if last else '') or deployment.state_detail}")
        time.sleep(1)
    replica = deployment.replica_set.filter(state="ready").first()
    _step(job, "wait", "done", f"replica on {replica.node.name}:{replica.port} ready")
    try:
        answer, rate = smoke_test(replica)
    except (httpx.HTTPError, KeyError, ValueError) as error:
        return _fail(job, "smoke", f"The engine did not answer: {error}")
    _step(job, "smoke", "done", f"{answer!r} at {rate:.1f} tokens/s")
    return _done(job, {"model": entry.name, "deployment": str(deployment.public_id), "answer": answer,
                       "tokens_per_second": round(rate, 2)})


def smoke_test(replica) -> tuple[str, float]:
    from serving.keys import replica_key

    started = time.monotonic()
    response = httpx.post(f"http://127.0.0.1:{replica.port}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {replica_key(replica.public_id)}"},
                          json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16})
    response.raise_for_status()
    body = response.json()
    elapsed = time.monotonic() - started
    tokens = body["usage"]["completion_tokens"]
    return body["choices"][0]["message"]["content"], tokens / elapsed if elapsed else 0.0


def _done(job: FetchJob, result: dict) -> FetchJob:
    FetchJob.objects.filter(pk=job.pk).update(status=FetchJob.Status.DONE, result=result, finished_at=timezone.now())
    job.refresh_from_db()
    return job
