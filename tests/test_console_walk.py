"""Every page and form of the console, as every persona, against acme's objects (the world of
``tests/assets/world.py``).

Pages: another organisation's owner (oscar) gets a 404 for each of acme/ml/search's objects, and no
page shown to him carries that project's names, ids or paths; its viewer (vera) and its team's member
(max) see them. Forms: a refused post changes nothing at all (no audit event, no row of the world),
whoever sends it; the person allowed to act (max for a member's verb, else olivia, the owner) does
change the world, which proves the post was one that would work. Nobody signed in is sent to log in.
A console route this table lacks fails the walk.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from tests.assets.world import build_world, leaked

pytestmark = pytest.mark.django_db

NOT_CONSOLE = ("api/", "v1/", "admin/", "static", "healthz", "readyz", "login/", "logout/")


@dataclasses.dataclass(frozen=True)
class Page:
    """A GET: ``target`` is the world's object its URL names (None: a list or a form page)."""

    target: str | None = None
    query: Callable | None = None
    staff_only: bool = False
    answers: frozenset = frozenset({200})  # what one who may open it gets


@dataclasses.dataclass(frozen=True)
class Form:
    """A POST. ``needs``: "use" (a member acts) or "change" (an admin acts) or "staff"."""

    needs: str
    target: str | None = None
    data: Callable = lambda w: {}
    owner_acts: bool = True  # whether the one allowed to act changes the world with this post
    actor: str | None = None  # who may act, when not max ("use") or olivia ("change")
    answers: frozenset = frozenset({200, 201, 302})  # what the one allowed to act gets


def scope_written(w):
    return w.scope.written


ROUTES = {
    "": Page(),
    "gateway/": Page(),
    "gateway/playground/": Page(),
    "gateway/splits/": Form("change", data=lambda w: {"model_name": "walk-split", "scope": w.scope.path,
                                                      "variants": f"{w.model.name}:1", "enabled": "on"}),
    "gateway/splits/<uuid:public_id>/delete/": Form("change", "split"),
    "gateway/batches/": Page(),
    "gateway/batches/<str:public_id>/": Page("batch"),
    "gateway/batches/<str:public_id>/cancel/": Form("use", "batch"),
    "models/": Page(),
    "models/deploy/": Form("use", data=lambda w: {"name": "walk-model", "model_path": w.weights_path,
                                                  "node": w.node.name, "task": "chat", "engine": "llamacpp",
                                                  "runtime": "process", "owner": scope_written(w),
                                                  "priority": 50},
                           owner_acts=False, answers=frozenset({200, 302, 400})),  # the file lies outside the roots
    "models/deploy/preview/": Form("use", data=lambda w: {"name": "walk-model", "model_path": w.weights_path,
                                                          "node": w.node.name, "task": "chat", "engine": "llamacpp",
                                                          "runtime": "process", "owner": scope_written(w),
                                                          "priority": 50}, owner_acts=False),
    "models/deployments/<uuid:public_id>/": Page("deployment"),
    "models/deployments/<uuid:public_id>/stream/": Page("deployment"),
    "models/deployments/<uuid:public_id>/reconfigure/": Form("use", "deployment", data=lambda w: {"context": 256},
                                                             owner_acts=False),
    "models/deployments/<uuid:public_id>/<str:verb>/": Form("use", "deployment"),  # remove
    "models/held/": Page(),
    "models/held/<uuid:public_id>/": Page("model"),
    # The world's model runs no replica: the one allowed is told there is nothing to restart.
    "models/held/<uuid:public_id>/restart/": Form("use", "model", owner_acts=False),
    # The hub is away here (a closed loopback port): the pages say so with a 503.
    "models/explore/": Page(query=lambda w: {"q": "walk"}, answers=frozenset({200, 503})),
    "models/fetch/": Form("use", data=lambda w: {"repo": "walk/repo", "owner": scope_written(w)}, owner_acts=False,
                          answers=frozenset({200, 302, 503})),
    "models/serve/": Form("use", data=lambda w: {"repo": "walk/repo", "owner": scope_written(w)}, owner_acts=False,
                          answers=frozenset({200, 302, 503})),
    "models/jobs/<uuid:public_id>/": Page("fetch"),
    "models/nodes/<uuid:public_id>/jobs/": Page("node", staff_only=True),  # a node's jobs: the node page's fragment
    "fleet/": Page(),
    "fleet/estimate/": Page(staff_only=True),
    "fleet/enrol/": Form("staff", data=lambda w: {"name": "walk-node", "expires_minutes": 60}),
    "fleet/placement/": Page(),
    "fleet/placement/parked/<path:model>/retry/": Form("staff", "model_name"),
    "fleet/nodes/<uuid:public_id>/": Page("node"),
    "fleet/nodes/<uuid:public_id>/labels/": Form("staff", "node", data=lambda w: {"labels": "zone=walk"}),
    "fleet/nodes/<uuid:public_id>/revoke/": Form("staff", "node"),
    "fleet/nodes/<uuid:public_id>/<slug:verb>/": Form("staff", "node", data=lambda w: {"reason": "walk"}),
    "organisations/": Page(),
    "organisations/scopes/<uuid:public_id>/": Page("scope"),
    "organisations/scopes/<uuid:public_id>/children/": Form("change", "team", data=lambda w: {"slug": "walk",
                                                                                               "name": "Walk"}),
    "organisations/scopes/<uuid:public_id>/contract/": Form("change", "scope", data=lambda w: {"gpus_limit": "2",
                                                                                                "rpm_limit": "100",
                                                                                                "budget_mode": "hard"}),
    "organisations/people/": Page(),
    "organisations/people/add/": Form("change", "scope", data=lambda w: {"username": "oscar", "role": "viewer",
                                                                         "scope": w.scope.public_id}),
    "organisations/memberships/<uuid:public_id>/role/": Form("change", "membership", data=lambda w: {"role": "member"}),
    "organisations/memberships/<uuid:public_id>/remove/": Form("change", "membership"),
    "organisations/clients/": Page(),
    "organisations/clients/new/": Form("use", data=lambda w: {"project": w.scope.public_id, "name": "walk-bot",
                                                              "environment": "development", "access": "inference",
                                                              "priority": "normal"}),
    "organisations/clients/<uuid:public_id>/": Page("client"),
    "organisations/clients/<uuid:public_id>/keys/": Form("use", "client", data=lambda w: {"name": "walk"}),
    "organisations/keys/<uuid:public_id>/revoke/": Form("use", "credential"),
    "organisations/keys/<uuid:public_id>/rotate/": Form("use", "credential", data=lambda w: {"overlap_hours": 1}),
    "organisations/approvals/": Page(),
    "organisations/approvals/ask/": Form("use", data=lambda w: {
        "action": "credential.create_production", "subject": w.client.public_id, "evidence": "{}",
        "reason": "walk"}, owner_acts=False),
    "organisations/approvals/<uuid:public_id>/": Page("approval"),
    # Four eyes: olivia asked for it, another admin of acme decides.
    "organisations/approvals/<uuid:public_id>/decide/": Form("change", "approval", data=lambda w: {
        "decision": "reject", "reason": "walk"}, actor="admin"),
    "organisations/audit/": Page(),
    "organisations/audit/export.jsonl": Page(),
}


def console_routes() -> list[str]:
    def walk(patterns, prefix=""):
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern):
                yield prefix + str(pattern.pattern)
    return [route for route in walk(get_resolver().url_patterns) if not route.startswith(NOT_CONSOLE)]


def test_every_console_route_is_walked():
    routes = console_routes()
    assert sorted(set(routes) - set(ROUTES)) == [], "declare who may open these new console routes in ROUTES"
    assert sorted(set(ROUTES) - set(routes)) == [], "these console routes are gone"


def url_of(route: str, spec, world) -> str:
    target = getattr(world, spec.target) if spec.target and spec.target != "model_name" else None
    public_id = getattr(target, "public_id", None)
    values = {"<uuid:public_id>": public_id, "<str:public_id>": public_id, "<path:model>": world.model.name,
              "<str:verb>": "remove", "<slug:verb>": "cordon"}
    for name, value in values.items():
        route = route.replace(name, str(value))
    assert "<" not in route, route
    return "/" + route


def world_state(world) -> list:
    """Everything a console form could change, as plain rows."""
    from gateway.models import Batch, ModelSplit
    from scheduler.models import Node, RecoveryState
    from serving.models import FetchJob, ModelEntry
    from serving.models import Deployment, Operation
    from tenancy.models import ApprovalRequest, AuditEvent, Contract, Credential, Membership, Scope, ServiceClient

    return [list(model.objects.order_by("pk").values_list(*fields)) for model, fields in (
        (AuditEvent, ("pk",)), (Scope, ("pk", "name")), (Membership, ("pk", "role")),
        (ServiceClient, ("pk", "access", "environment", "is_active")),
        (Credential, ("pk", "revoked_at", "expires_at")), (Contract, ("pk", "gpus_limit", "rpm_limit")),
        (ApprovalRequest, ("pk", "status")), (ModelSplit, ("pk", "enabled", "variants")), (Batch, ("pk", "status")),
        (Deployment, ("pk", "state")), (Operation, ("pk",)), (ModelEntry, ("pk", "scaling_max")),
        (FetchJob, ("pk", "status")), (Node, ("pk", "state")), (RecoveryState, ("pk", "parked")))]


def signed_in(user) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


def text_of(response) -> str:
    if getattr(response, "streaming", False):
        return b"".join(response.streaming_content).decode(errors="replace")
    return response.content.decode(errors="replace")


def open_stream(user, world):
    """The deployment's live stream (server-sent events, endless with Redis), called as the view it
    is: its status says whether the caller may listen; nothing is read from it."""
    from asgiref.sync import async_to_sync
    from django.contrib.auth.models import AnonymousUser
    from django.http import Http404
    from django.test import RequestFactory

    from serving.views.deployments import deployment_stream

    request = RequestFactory().get(f"/models/deployments/{world.deployment.public_id}/stream/")

    async def auser():
        return user or AnonymousUser()

    request.auser = auser
    try:
        response = async_to_sync(deployment_stream)(request, public_id=world.deployment.public_id)
    except Http404:
        return 404
    return response.status_code


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_console_walk(route, personas, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: the hub is away
    world = build_world(personas)
    spec = ROUTES[route]
    url = url_of(route, spec, world)
    problems = []

    asked = f"{url} {spec.data(world) if isinstance(spec, Form) else ''}"  # one's own words echoed tell nothing

    def check(persona, response, allowed):
        text = text_of(response)
        if response.status_code not in allowed:
            problems.append(f"{persona}: {response.status_code} (expected {sorted(allowed)}) {text[:300]}")
        found = [secret for secret in leaked(world, text, outsider_of_acme=True) if secret not in asked]
        if persona == "oscar" and found:
            problems.append(f"oscar: the page carries {found}")

    if route.endswith("/stream/"):  # a live stream: who may listen, and that nothing leaks by its status
        answers = {persona: open_stream(getattr(personas, persona, None), world)
                   for persona in ("anonymous", "oscar", "vera", "max")}
        assert answers["anonymous"] == answers["oscar"] == 404 and answers["vera"] == answers["max"] in (200, 204), \
            answers
        return

    anonymous = Client().get(url) if isinstance(spec, Page) else Client().post(url, {})
    if anonymous.status_code != 302 or "/login/" not in anonymous.get("Location", ""):
        problems.append(f"anonymous: {anonymous.status_code}, not sent to log in")

    if isinstance(spec, Page):
        query = spec.query(world) if spec.query else None
        seen = set(spec.answers) if not spec.staff_only else {403}
        hidden = {404} if spec.target and spec.target not in ("node",) else seen
        check("oscar", signed_in(personas.oscar).get(url, query), hidden)
        for persona in ("vera", "max"):
            check(persona, signed_in(getattr(personas, persona)).get(url, query), seen)
    else:
        data = spec.data(world)
        refused = ["oscar", "vera"] + (["max"] if spec.needs in ("change", "staff") else [])
        for persona in refused:
            before = world_state(world)
            response = signed_in(getattr(personas, persona)).post(url, data)
            allowed = {404} if persona == "oscar" and spec.target and spec.needs != "staff" else {200, 302, 400, 403,
                                                                                                   404}
            check(persona, response, allowed)
            if world_state(world) != before:
                problems.append(f"{persona}: a refused post changed the world ({response.status_code})")
        actor = spec.actor or {"use": "max", "change": "olivia"}.get(spec.needs)
        if actor is not None:
            before = world_state(world)
            response = signed_in(getattr(world, actor, None) or getattr(personas, actor)).post(url, data)
            check(actor, response, spec.answers)
            if spec.owner_acts and world_state(world) == before:
                problems.append(f"{actor} may act, but the post changed nothing ({response.status_code}): "
                                f"{text_of(response)[:300]}")
    assert not problems, f"{url}\n" + "\n".join(problems)
