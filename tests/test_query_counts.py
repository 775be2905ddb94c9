"""How many SQL queries each console list page and each API list endpoint costs, against committed
baselines (tests/baselines/query_counts.json), so an N+1 shows as a diff.

Every list has objects in it (the world of ``tests/assets/world.py``) and acme's owner (olivia) asks.
A page that costs more than its baseline fails; one that costs less fails too, so the file stays true.
Where a page lists many of a kind, more of that kind are added (one, then two more) and the count must
not rise between the two: that is the N+1 itself, whatever the baseline says.

To accept new counts: ``BERTH_UPDATE_QUERY_BASELINES=1 make test`` (or the same variable before
``deploy/scripts/test.sh tests/test_query_counts.py``) rewrites the file; commit its diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from tests.assets.world import build_world
from tests.test_console_walk import ROUTES, Page
from tests.test_persona_walk import CASES, operations, schema, url_of as api_url_of  # noqa: F401  (schema: a fixture)

pytestmark = pytest.mark.django_db

BASELINES = Path(__file__).resolve().parent / "baselines" / "query_counts.json"
UPDATE = os.environ.get("BERTH_UPDATE_QUERY_BASELINES") == "1"
HOW_TO_UPDATE = ("if that is intended, rewrite the baselines with `BERTH_UPDATE_QUERY_BASELINES=1 make test` "
                 "(or that variable before `deploy/scripts/test.sh tests/test_query_counts.py`) and commit "
                 "tests/baselines/query_counts.json")


# More of a kind, as the world makes its one: ``more(world, n)`` adds the n-th and returns what of it
# the list shows (its name or id), so the check knows the list really grew.

def more_deployments(w, n):
    from serving.models import Deployment, DeploymentEvent, Replica

    deployment = Deployment.objects.create(name=f"more-model-{n}", model_path=w.weights_path, node=w.node,
                                           owner=w.scope, state="ready", created_by=w.personas.max,
                                           memory_reserved_bytes=2**20)
    replica = Replica.objects.create(deployment=deployment, node=w.node, port=9000 + n, state="ready")
    DeploymentEvent.objects.create(deployment=deployment, replica=replica, from_state="planned", to_state="ready",
                                   message="more")
    return deployment.name


def more_deployment_events(w, n):
    from serving.models import DeploymentEvent

    return DeploymentEvent.objects.create(deployment=w.deployment, from_state="stopped", to_state="stopped",
                                          message=f"more {n}").message


def more_catalog_models(w, n):
    from serving.models import ModelEntry, ModelFile

    path = f"/models/more-{n}.gguf"
    model = ModelEntry.objects.create(name=f"more-model-{n}", owner=w.scope, source_kind="local", source_path=path,
                                      format="gguf", task="chat",
                                      profiles=[{"name": "cpu", "engine": "llamacpp", "file": f"more-{n}.gguf",
                                                 "context": 512}])
    ModelFile.objects.create(model=model, repo_path=f"more-{n}.gguf", path=path, size=1024)
    return model.name


def more_model_files(w, n):
    from serving.models import ModelFile

    ModelFile.objects.create(model=w.model, repo_path=f"more-{n}.gguf", path=f"/models/more-{n}.gguf", size=1024)
    return f"more-{n}.gguf"


def more_fetches(w, n):
    from serving.models import FetchJob

    return FetchJob.objects.create(repo=f"more/repo-{n}", owner=w.scope, status="failed", error="more").repo


def more_nodes(w, n):
    from scheduler.models import Accelerator
    from scheduler.services import EngineReport, NodeReport, register_node

    node = register_node(NodeReport(name=f"more-node-{n}", address="127.0.0.1", cpu_count=8,
                                    memory_total_bytes=2**34, engines=(EngineReport(kind="llamacpp", version="b1"),)))
    Accelerator.objects.create(node=node, index=0, uuid=f"GPU-more-{n}", name="NVIDIA H100 80GB HBM3",
                               accelerator_class="H100-80GB", memory_total_bytes=80 * 2**30)
    return node.name


def more_accelerators(w, n):
    from scheduler.models import Accelerator

    return Accelerator.objects.create(node=w.node, index=n, uuid=f"GPU-walk-{n}", name="NVIDIA H100 80GB HBM3",
                                      accelerator_class="H100-80GB", memory_total_bytes=80 * 2**30).uuid


def more_decisions(w, n):
    from scheduler.models import PlacementDecision

    return PlacementDecision.objects.create(model=f"more-model-{n}", owner=w.scope, verdict="unschedulable",
                                            reason_codes=["no_fit"], detail="does not fit",
                                            inputs_digest=f"{n}" * 32, fingerprint=f"{n}" * 32).model


def more_audit_events(w, n):
    from tenancy.audit import Actor, record

    # Each by someone else, about something else: the actor and the subject are what a list shows.
    return str(record(Actor(user=(w.personas.max, w.admin)[n % 2]), "client.update", w.client,
                      details={"n": n}).public_id)


def more_usage(w, n):
    from gateway.models import UsageRecord
    from tenancy.services import clients

    client = clients.create_client(w.personas.olivia_actor, w.scope, f"more-usage-{n}", all_models=True)
    credential, _ = clients.create_credential(w.personas.olivia_actor, client, name="more")
    now = timezone.now()
    UsageRecord.objects.create(
        request_id=f"more-request-{n}", started_at=now - timedelta(seconds=2), finished_at=now,
        endpoint="chat/completions", model_asked=w.model.name, model_served=w.model.name, status=200,
        total_ms=12.0, prompt_tokens=3, completion_tokens=4, credential=credential, key_prefix=credential.prefix,
        client=client, project=w.scope, scope_path=w.scope.path)
    return f"more-request-{n}"


def more_clients(w, n):
    from tenancy.services import clients

    client = clients.create_client(w.personas.olivia_actor, w.scope, f"more-client-{n}", all_models=True)
    clients.create_credential(w.personas.olivia_actor, client, name="more")
    return client.name


def more_keys(w, n):
    from tenancy.services import clients

    return clients.create_credential(w.personas.olivia_actor, w.client, name=f"more-key-{n}")[0].prefix


def more_members(w, n):
    from django.contrib.auth import get_user_model

    from tenancy.models import Membership

    user = get_user_model().objects.create_user(f"more{n}", f"more{n}@example.org", w.personas.password)
    Membership.objects.create(user=user, scope=w.scope, role="viewer")
    return user.username


def more_scopes(w, n):
    from tenancy.services import tree

    return tree.create_scope(w.personas.olivia_actor, "project", f"more{n}", f"More {n}", w.team).path


def more_splits(w, n):
    from gateway.models import ModelSplit

    return ModelSplit.objects.create(model_name=f"more-split-{n}", scope=w.scope,
                                     variants=[{"model": w.model.name, "weight": 1}]).model_name


@dataclasses.dataclass(frozen=True)
class ListPage:
    key: str  # the baseline's name: "GET <path>", the API's path as its schema writes it
    console_route: str | None = None
    operation: str | None = None
    more: Callable | None = None  # adds one more of the listed kind


# The console's pages with no object of their own, except those that are not lists of Berth's rows:
# the hub's search (another system) and the operator's estimate form.
NOT_LISTS = ("models/explore/", "fleet/estimate/")
CONSOLE_MORE = {
    "": more_catalog_models, "gateway/": more_usage, "models/": more_deployments, "models/held/": more_catalog_models, "fleet/": more_nodes,
    "fleet/placement/": more_decisions, "organisations/": more_scopes, "organisations/people/": more_members,
    "organisations/clients/": more_clients, "organisations/audit/": more_audit_events,
    "organisations/audit/export.jsonl": more_audit_events,
}
# The API's list operations: every GET of a collection an owner may call (the operators' own,
# calibrations, are not the owner's to list).
API_MORE = {
    "tenancy_scopes_list": more_scopes, "tenancy_memberships_list": more_members, "tenancy_clients_list": more_clients,
    "tenancy_credentials_list": more_keys, "tenancy_audit_list": more_audit_events,
    "tenancy_audit_export_retrieve": more_audit_events, "scheduler_nodes_list": more_nodes,
    "scheduler_accelerators_list": more_accelerators, "scheduler_decisions_list": more_decisions,
    "serving_deployments_list": more_deployments, "serving_deployments_events_list": more_deployment_events,
    "serving_catalog_models_list": more_catalog_models, "serving_catalog_files_list": more_model_files,
    "serving_catalog_fetches_list": more_fetches, "gateway_splits_list": more_splits, "gateway_usage_list": more_usage,
}


def console_pages() -> list[ListPage]:
    return [ListPage(f"GET /{route}", console_route=route, more=CONSOLE_MORE.get(route))
            for route, spec in ROUTES.items()
            if isinstance(spec, Page) and spec.target is None and route not in NOT_LISTS]


def api_operations() -> list[str]:
    return sorted(op for op, case in CASES.items() if case.kind != "staff"
                  and (op.endswith("_list") or (case.kind == "list" and op.endswith("_retrieve"))))


def read_baselines() -> dict[str, int]:
    return json.loads(BASELINES.read_text()) if BASELINES.is_file() else {}


def write_baselines(update: Callable[[dict], None]) -> None:
    baselines = read_baselines()
    update(baselines)
    BASELINES.parent.mkdir(exist_ok=True)
    BASELINES.write_text(json.dumps(dict(sorted(baselines.items())), indent=2) + "\n")


def count_queries(get) -> tuple[int, list[str], str]:
    """The queries of one GET (its streamed body read too) and its body, after a first GET that
    warms what any process caches once (content types, a session's first touch)."""

    def call() -> str:
        response = get()
        body = (b"".join(response.streaming_content) if getattr(response, "streaming", False)
                else response.content).decode(errors="replace")
        assert response.status_code == 200, f"{response.status_code}: {body[:300]}"
        return body

    call()
    with CaptureQueriesContext(connection) as captured:
        body = call()
    return len(captured), [query["sql"] for query in captured.captured_queries], body


def check(key: str, get, more: Callable | None, world) -> None:
    count, queries, _ = count_queries(get)
    problems = []
    if UPDATE:
        write_baselines(lambda baselines: baselines.__setitem__(key, count))
    else:
        baseline = read_baselines().get(key)
        if baseline is None:
            problems.append(f"{key} has no baseline ({count} queries now): {HOW_TO_UPDATE}")
        elif count > baseline:
            listed = "\n".join(f"  {sql[:200]}" for sql in queries)
            problems.append(f"{key} costs {count} queries, its baseline {baseline}: more than before, {HOW_TO_UPDATE}."
                            f"\nIts queries:\n{listed}")
        elif count < baseline:
            problems.append(f"{key} costs {count} queries, its baseline {baseline}: fewer, so lower the baseline "
                            f"(the file must stay true): {HOW_TO_UPDATE}")
    if more is not None:
        # Two of the kind as ``more`` makes them (so both counts see rows of the same shape), then four.
        shown = [more(world, 2)]
        fewer, _, _ = count_queries(get)
        shown += [more(world, 3), more(world, 4)]
        grown, grown_queries, body = count_queries(get)
        missing = [text for text in shown if text not in body]
        assert not missing, f"{key} does not show what {more.__name__} added ({missing}): the check proves nothing"
        if grown > fewer:
            listed = "\n".join(f"  {sql[:200]}" for sql in grown_queries)
            problems.append(f"{key}: {fewer} queries with two {more.__name__[5:]}, {grown} with four: a query per "
                            f"row (N+1); load the related rows with select_related/prefetch_related.\n"
                            f"Its queries:\n{listed}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", console_pages(), ids=lambda page: page.key)
def test_console_list_page_costs_its_baseline(page, personas):
    world = build_world(personas)
    client = Client()
    client.force_login(personas.olivia)
    check(page.key, lambda: client.get("/" + page.console_route), page.more, world)


@pytest.mark.parametrize("operation", api_operations())
def test_api_list_costs_its_baseline(operation, schema, personas):  # noqa: F811  (schema: the fixture)
    ops = operations(schema)
    assert operation in ops, f"{operation} is not in the schema any more"
    method, path = ops[operation]
    assert method == "GET", f"{operation} is a {method}, not a list"
    case = CASES[operation]
    world = build_world(personas)
    client = APIClient()
    client.force_login(personas.olivia)
    url = api_url_of(path, case, world)
    query = case.query(world) if case.query else None
    check(f"GET {path}", lambda: client.get(url, query, HTTP_ACCEPT="application/json"),
          API_MORE.get(operation), world)


def test_the_baselines_name_every_list_and_only_those(schema):  # noqa: F811  (schema: the fixture)
    ops = operations(schema)
    expected = {page.key for page in console_pages()} | {f"GET {ops[op][1]}" for op in api_operations() if op in ops}
    if UPDATE:
        write_baselines(lambda baselines: [baselines.pop(key) for key in set(baselines) - expected])
        return
    stale = sorted(set(read_baselines()) - expected)
    assert not stale, f"tests/baselines/query_counts.json names lists that are gone: {stale}; {HOW_TO_UPDATE}"


def test_the_biggest_lists_are_checked_for_a_query_per_row():
    """The lists that grow longest in a real organisation: each has its "more of the kind" step."""
    console = {page.console_route for page in console_pages() if page.more}
    api = {op for op in api_operations() if op in API_MORE}
    assert {"models/", "models/held/", "fleet/", "organisations/audit/", "gateway/",
            "organisations/clients/"} <= console
    assert {"serving_deployments_list", "serving_catalog_models_list", "scheduler_nodes_list", "tenancy_audit_list",
            "gateway_usage_list", "tenancy_clients_list", "tenancy_credentials_list"} <= api
    assert set(API_MORE) <= set(api_operations()), "API_MORE names an operation that is not a list"
    assert set(CONSOLE_MORE) <= {page.console_route for page in console_pages()}, "CONSOLE_MORE names no list page"
