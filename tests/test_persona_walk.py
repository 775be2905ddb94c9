"""Every operation of the OpenAPI schema, called as every persona against acme's objects.

The personas: another organisation's owner (oscar), another organisation's management key, a sibling
project's management key (acme/ml/other), a viewer of the project (vera), a member of its team (max),
and nobody at all. Each operation is declared below with what it acts on and what it needs; the walk
asserts 404 for what a caller cannot see, 403 for what it can see but not do, and that no answer to a
caller outside acme/ml/search carries that project's names, ids or paths. An operation the schema has
and this table lacks fails the walk: a new endpoint must say who may call it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
from rest_framework.test import APIClient

from tests.assets.world import build_world, leaked

pytestmark = pytest.mark.django_db

OUTSIDERS = ("oscar", "globex_key", "sibling_key")
PERSONAS = (*OUTSIDERS, "vera", "max", "anonymous")
OK = frozenset({200, 201, 202, 204})
# What a caller allowed to act may still be told: the object is in the wrong state, or the body is
# refused for a reason of its own (never a 403, a 404 or a server error).
MAY_ACT = OK | {400, 409}
HIDDEN, FORBIDDEN = frozenset({404}), frozenset({403})
ANONYMOUS = frozenset({401, 403})

# The least each kind of operation lets each persona do (overrides per case below).
KINDS = {
    "list": {"outsider": OK, "vera": OK, "max": OK},             # a collection: theirs only
    "read": {"outsider": HIDDEN, "vera": OK, "max": OK},          # one of acme/ml/search's objects
    "use": {"outsider": HIDDEN, "vera": FORBIDDEN, "max": MAY_ACT},  # a member's verb
    "change": {"outsider": HIDDEN, "vera": FORBIDDEN, "max": FORBIDDEN},  # an admin's verb
    "fleet": {"outsider": OK, "vera": OK, "max": OK},             # the shared fleet: no tenant's details
    "staff": {"outsider": FORBIDDEN, "vera": FORBIDDEN, "max": FORBIDDEN},  # operators only
}


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    target: str | None = None  # the world's object whose id fills the path
    body: Callable | None = None  # world -> request body
    query: Callable | None = None  # world -> query parameters
    expect: dict = dataclasses.field(default_factory=dict)  # persona -> statuses, over the kind's

    def allowed(self, persona: str) -> frozenset:
        if persona == "anonymous":
            return self.expect.get("anonymous", ANONYMOUS)
        if persona in self.expect:
            return self.expect[persona]
        return KINDS[self.kind]["outsider" if persona in OUTSIDERS else persona]


def scope_of(w):
    return w.scope.written


def model_shape(w):
    return {"model": w.model.name, "profiles": [{"name": "cpu", "engine": "llamacpp", "memory_gib": 1}],
            "owner": scope_of(w)}


def deploy_body(w):
    return {"name": "walk-model", "model_path": w.weights_path, "node": str(w.node.public_id), "owner": scope_of(w)}


NODE_ONLY = {persona: frozenset({401}) for persona in PERSONAS}  # the node API: a node's credential only
NOT_VISIBLE_TEAM = {"vera": HIDDEN}  # vera views the project only, not the team above it
# The hub is another system (here a closed loopback port): whoever may use it gets its answer, or a 502/503
# saying it is away.
HUB_AWAY = frozenset({502, 503})
HUB_USE = {"max": MAY_ACT | HUB_AWAY}
HUB_READ = {p: OK | HUB_AWAY for p in (*OUTSIDERS, "vera", "max")}

CASES = {
    # --- tenancy ---
    "tenancy_scopes_list": Case("list"),
    "tenancy_scopes_create": Case("change", body=lambda w: {"kind": "project", "slug": "walk",
                                                            "parent": w.team.written}, expect=NOT_VISIBLE_TEAM),
    "tenancy_scopes_retrieve": Case("read", "scope"),
    "tenancy_scopes_partial_update": Case("change", "scope", body=lambda w: {"name": "Renamed"}),
    "tenancy_scopes_destroy": Case("change", "scope"),
    "tenancy_scopes_resolve_retrieve": Case("read", query=lambda w: {"scope": scope_of(w)}),
    "tenancy_memberships_list": Case("list"),
    "tenancy_memberships_create": Case("change", body=lambda w: {"username": "oscar", "scope": scope_of(w),
                                                                 "role": "viewer"}),
    "tenancy_memberships_retrieve": Case("read", "membership"),
    "tenancy_memberships_partial_update": Case("change", "membership", body=lambda w: {"role": "member"}),
    "tenancy_memberships_destroy": Case("change", "membership"),
    "tenancy_clients_list": Case("list"),
    "tenancy_clients_create": Case("use", body=lambda w: {"project": scope_of(w), "name": "walk-bot"}),
    "tenancy_clients_retrieve": Case("read", "client"),
    "tenancy_clients_partial_update": Case("use", "client", body=lambda w: {"description": "walked"}),
    "tenancy_clients_destroy": Case("use", "client"),
    "tenancy_credentials_list": Case("list"),
    "tenancy_credentials_create": Case("use", body=lambda w: {"client": str(w.client.public_id), "name": "walk"}),
    "tenancy_credentials_retrieve": Case("read", "credential"),
    "tenancy_credentials_revoke_create": Case("use", "credential"),
    "tenancy_credentials_rotate_create": Case("use", "credential", body=lambda w: {"overlap_hours": 1}),
    "tenancy_contracts_list": Case("list"),
    "tenancy_contracts_retrieve": Case("read", "scope"),
    "tenancy_contracts_update": Case("change", "scope", body=lambda w: {"gpus_limit": 2, "rpm_limit": 100}),
    "tenancy_contracts_partial_update": Case("change", "scope", body=lambda w: {"gpus_limit": 2}),
    "tenancy_contracts_chain_list": Case("read", query=lambda w: {"scope": scope_of(w)}),
    "tenancy_contracts_check_create": Case("read", body=lambda w: {"scope": scope_of(w), "gpus": 1}),
    "tenancy_approvals_list": Case("list"),
    "tenancy_approvals_create": Case("use", body=lambda w: {"action": "contract.raise_limit", "reason": "walk",
                                                            "scope": scope_of(w), "proposed": {"gpus_limit": 6}}),
    "tenancy_approvals_retrieve": Case("read", "approval"),
    "tenancy_approvals_approve_create": Case("change", "approval", body=lambda w: {"reason": "walk"}),
    "tenancy_approvals_reject_create": Case("change", "approval", body=lambda w: {"reason": "walk"}),
    "tenancy_audit_list": Case("list"),
    "tenancy_audit_retrieve": Case("read", "audit_event"),
    "tenancy_audit_export_retrieve": Case("list"),
    # --- scheduler ---
    "scheduler_nodes_list": Case("fleet"),
    "scheduler_nodes_retrieve": Case("fleet", "node"),
    "scheduler_nodes_cordon_create": Case("staff", "node", body=lambda w: {"reason": "walk"}),
    "scheduler_nodes_uncordon_create": Case("staff", "node", body=lambda w: {"reason": "walk"}),
    "scheduler_nodes_drain_create": Case("staff", "node", body=lambda w: {"reason": "walk"}),
    "scheduler_nodes_labels_update": Case("staff", "node", body=lambda w: {"labels": {"zone": "walk"}}),
    # What moves off a node names every tenant's models: operators only.
    "scheduler_nodes_moves_retrieve": Case("staff", "node"),
    "scheduler_accelerators_list": Case("fleet"),
    "scheduler_accelerators_retrieve": Case("fleet", "accelerator"),
    # A calibration record names a tenant's model and file and why its load failed: staff only.
    "scheduler_calibrations_list": Case("staff"),
    "scheduler_calibrations_retrieve": Case("staff", "calibration"),
    "scheduler_calibrations_destroy": Case("staff", "calibration"),
    "scheduler_calibrations_reset_create": Case("staff"),
    "scheduler_estimate_create": Case("staff", body=lambda w: {"model_path": w.weights_path, "engine": "llamacpp"}),
    "scheduler_decisions_list": Case("list"),
    "scheduler_decisions_retrieve": Case("read", "decision"),
    "scheduler_placement_explain_create": Case("read", body=model_shape),
    "scheduler_placement_headroom_create": Case("read", body=model_shape),
    "scheduler_placement_parked_retrieve": Case("list"),
    "scheduler_placement_parked_retry_create": Case("staff", "model_name"),
    # Node trust is the operators': tokens that enrol a node, and revoking one.
    "scheduler_nodes_revoke_create": Case("staff", "node"),
    "scheduler_enrolment_tokens_list": Case("staff"),
    "scheduler_enrolment_tokens_create": Case("staff", body=lambda w: {"name": "walk-node", "expires_minutes": 60}),
    # Refused before any lookup (no persona is staff), so any id fills the path: the node's.
    "scheduler_enrolment_tokens_destroy": Case("staff", "node"),
    # --- the node API ---
    # Enrolment takes a token and nothing else (no session, no key): one Berth never issued is refused alike.
    "node_enrol_create": Case("fleet", body=lambda w: {"token": "bne_0123456789ab_" + "x" * 43, "name": "walk-node",
                                                       "address": "127.0.0.1"}, expect=NODE_ONLY),
    # --- serving ---
    "serving_deployments_list": Case("list"),
    "serving_deployments_create": Case("use", body=deploy_body),
    "serving_deployments_preview_create": Case("use", body=deploy_body),
    "serving_deployments_retrieve": Case("read", "deployment"),
    "serving_deployments_destroy": Case("use", "deployment"),
    "serving_deployments_events_list": Case("read", "deployment"),
    "serving_deployments_operations_list": Case("read", "deployment"),
    "serving_deployments_start_create": Case("use", "deployment"),
    "serving_deployments_stop_create": Case("use", "deployment"),
    "serving_deployments_sleep_create": Case("use", "deployment"),
    "serving_deployments_wake_create": Case("use", "deployment"),
    "serving_deployments_reconfigure_create": Case("use", "deployment", body=lambda w: {"config": {"ctx_size": 256}}),
    "serving_deployments_switch_create": Case("use", "deployment", body=lambda w: {"model_path": w.weights_path}),
    "serving_catalog_models_list": Case("list"),
    "serving_catalog_models_retrieve": Case("read", "model"),
    # A scope's own catalog models are its members' to place and prune, as its deployments are.
    "serving_catalog_models_partial_update": Case("use", "model", body=lambda w: {"scaling_max": 2}),
    "serving_catalog_models_remove_files_create": Case("use", "model"),
    "serving_catalog_models_room_retrieve": Case("read", "model"),
    # A rolling restart is a member's verb, as a change of placement is; following it, a reader's.
    "serving_catalog_models_restart_create": Case("use", "model"),
    "serving_catalog_models_restart_retrieve": Case("read", "model"),
    # A model that cannot be served is said so with a 409 (its file is not verified here).
    "serving_catalog_models_servability_retrieve": Case("read", "model", expect={"vera": OK | {409},
                                                                                 "max": OK | {409}}),
    "serving_catalog_models_garbage_collect_create": Case("staff"),
    "serving_catalog_files_list": Case("list"),
    "serving_catalog_fetches_list": Case("list"),
    "serving_catalog_fetches_create": Case("use", body=lambda w: {"repo": "walk/repo", "owner": scope_of(w)},
                                           expect=HUB_USE),
    "serving_catalog_fetches_retrieve": Case("read", "fetch"),
    "serving_catalog_fetches_resume_create": Case("use", "fetch"),
    "serving_serve_create": Case("use", body=lambda w: {"repo": "walk/repo", "owner": scope_of(w)},
                                 expect=HUB_USE),
    "serving_hub_search_retrieve": Case("fleet", query=lambda w: {"q": "walk"}, expect=HUB_READ),
    "serving_hub_files_retrieve": Case("fleet", query=lambda w: {"repo": "walk/repo"}, expect=HUB_READ),
    # The fleet's figures for everyone; the models, replicas and failures in it are the caller's own.
    "serving_status_retrieve": Case("list"),
    # The node API's leased jobs take a node's own credential, nobody else's: every persona is refused before
    # any lookup (the id in the path is any of the world's; no job is reached).
    "node_jobs_claim_create": Case("staff", body=lambda w: {"wait": 0}, expect=NODE_ONLY),
    "node_self_retrieve": Case("staff", expect=NODE_ONLY),
    "node_heartbeat_create": Case("staff", body=lambda w: {"report": {"name": "walk-node", "address": "127.0.0.1"}},
                                  expect=NODE_ONLY),
    "node_jobs_lease_create": Case("staff", "node", body=lambda w: {"lease": "bnl_walk"}, expect=NODE_ONLY),
    "node_jobs_report_create": Case("staff", "node", body=lambda w: {"lease": "bnl_walk", "event": "say"},
                                    expect=NODE_ONLY),
    "node_jobs_complete_create": Case("staff", "node", body=lambda w: {"lease": "bnl_walk"}, expect=NODE_ONLY),
    "node_jobs_fail_create": Case("staff", "node", body=lambda w: {"lease": "bnl_walk", "error": "walk"},
                                  expect=NODE_ONLY),
    # --- gateway ---
    "gateway_batches_list": Case("list"),
    "gateway_batches_retrieve": Case("read", "batch"),
    "gateway_batches_cancel_create": Case("use", "batch"),
    "gateway_splits_list": Case("list"),
    "gateway_splits_create": Case("change", body=lambda w: {"model_name": "walk-split", "scope": w.scope.path,
                                                            "variants": [{"model": w.model.name, "weight": 1}]}),
    "gateway_splits_retrieve": Case("read", "split"),
    "gateway_splits_update": Case("change", "split", body=lambda w: {"model_name": w.split.model_name,
                                                                     "scope": w.scope.path, "enabled": False}),
    "gateway_splits_partial_update": Case("change", "split", body=lambda w: {"enabled": False}),
    "gateway_splits_destroy": Case("change", "split"),
    "gateway_usage_list": Case("list"),
    "gateway_usage_retrieve": Case("read", "usage"),
}


def operations(schema) -> dict[str, tuple[str, str]]:
    return {op["operationId"]: (method.upper(), path) for path, ops in schema["paths"].items()
            for method, op in ops.items() if method in ("get", "post", "put", "patch", "delete")}


@pytest.fixture(scope="module")
def schema(django_db_setup, django_db_blocker):
    from drf_spectacular.generators import SchemaGenerator

    with django_db_blocker.unblock():
        return SchemaGenerator().get_schema(request=None, public=True)


def test_every_operation_of_the_schema_is_walked(schema):
    ops = operations(schema)
    assert sorted(set(ops) - set(CASES)) == [], "declare who may call these new operations in CASES"
    assert sorted(set(CASES) - set(ops)) == [], "these operations are gone from the schema"


def url_of(path: str, case: Case, world) -> str:
    target = getattr(world, case.target) if case.target and case.target != "model_name" else None
    values = {"public_id": getattr(target, "public_id", None), "scope_id": world.scope.public_id,
              "request_id": world.usage.request_id, "model": world.model.name}
    for name, value in values.items():
        path = path.replace("{" + name + "}", str(value))
    assert "{" not in path, f"no value for a parameter of {path}"
    return path


def caller(world, persona: str) -> APIClient:
    client = APIClient()
    if persona in ("globex_key", "sibling_key"):
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {getattr(world, persona)}")
    elif persona != "anonymous":
        client.force_login(getattr(world.personas, persona))
    return client


@pytest.mark.parametrize("operation", sorted(CASES))
def test_persona_walk(operation, schema, personas, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    ops = operations(schema)
    if operation not in ops:
        pytest.fail(f"{operation} is not in the schema any more")
    method, path = ops[operation]
    case = CASES[operation]
    world = build_world(personas)
    url = url_of(path, case, world)
    body = case.body(world) if case.body else None
    query = case.query(world) if case.query else None
    asked = f"{url} {body} {query}"  # a caller's own words echoed back tell it nothing
    problems = []
    # Outsiders first: an operation that one of them could wrongly complete would change the world.
    for persona in PERSONAS:
        client = caller(world, persona)
        if method == "GET":
            response = client.get(url, query, HTTP_ACCEPT="application/json")
        else:
            response = client.generic(method, url, data=None if body is None else _json(body),
                                      content_type="application/json", HTTP_ACCEPT="application/json")
        text = response.content.decode(errors="replace") if not getattr(response, "streaming", False) \
            else b"".join(response.streaming_content).decode(errors="replace")
        if response.status_code not in case.allowed(persona):
            expected = sorted(case.allowed(persona))
            problems.append(f"{persona}: {response.status_code} (expected {expected}) {text[:300]}")
        if persona in OUTSIDERS or persona == "anonymous":
            found = [secret for secret in leaked(world, text, outsider_of_acme=persona != "sibling_key")
                     if secret not in asked]
            if found:
                problems.append(f"{persona}: the answer carries {found}: {text[:300]}")
    assert not problems, f"{method} {url}\n" + "\n".join(problems)


def _json(body) -> str:
    import json

    return json.dumps(body)
