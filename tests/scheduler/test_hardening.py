"""The scheduler's pages and API for one tenant among several, on either database: the latest decision
per model read without PostgreSQL's DISTINCT ON; a dry run's owner resolved among the caller's scopes;
decisions read by those who see the model's owner; the fleet's capacity for everyone, its model
files and the estimate of a path for staff."""

import pytest

from scheduler.models import PlacementDecision
from scheduler.placement_service import record_plan
from scheduler.policy.inputs import GIB, DesiredModel, Profile, Scaling
from scheduler.policy.plan import schedule
from scheduler.reports import HeldWeightReport, ModelDirectoryReport
from scheduler.services import EngineReport, NodeReport, register_node
from scheduler.snapshot import current_snapshot
from tenancy.services import contracts

pytestmark = pytest.mark.django_db

EXPLAIN, HEADROOM = "/api/scheduler/placement/explain/", "/api/scheduler/placement/headroom/"
DECISIONS, PARKED = "/api/scheduler/decisions/", "/api/scheduler/placement/parked/"


def llm(mid, gib=30, gpus=1, **kw):
    return DesiredModel(mid, (Profile("default", "vllm", gpus, gib * GIB),), **kw)


def shape(owner="", gpus=2, name="probe"):
    return {"model": name, "profiles": [{"name": "gpu", "engine": "vllm", "gpus": gpus, "memory_gib": 10}],
            "min": 1, "owner": owner, "limit": 4}


def post(client, url, body):
    return client.post(url, body, content_type="application/json")


def results(response):
    body = response.json()
    return body["results"] if isinstance(body, dict) else body


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user("stella", "stella@example.org", "a-long-test-password",
                                                 is_staff=True)


@pytest.fixture
def tenants_decided(personas, h100_node):
    """A plan recorded for a model of acme/ml/search, one of globex and a shared one; each model
    decided twice, the latest verdict differing from the first."""
    models = (llm("acme-search-llm", owner="acme/ml/search"), llm("globex-secret-llm", owner="globex"),
              llm("shared-llm"))
    fits = current_snapshot(models, now=1000.0)
    record_plan(fits, schedule(fits))  # all placed
    too_big = tuple(llm(m.id, gib=500, owner=m.owner) for m in models)
    refused = current_snapshot(too_big, now=1001.0)
    record_plan(refused, schedule(refused))  # then all unschedulable: the latest
    return personas


# --- the latest decision per model, on SQLite too -----------------------------------------------

def test_parked_api_and_placement_page_read_the_latest_decision_per_model(client, staff, h100_node):
    first = current_snapshot((llm("was-refused", gib=500), llm("now-refused")), now=1000.0)
    record_plan(first, schedule(first))
    then = current_snapshot((llm("was-refused"), llm("now-refused", gib=500)), now=1001.0)
    record_plan(then, schedule(then))
    client.force_login(staff)
    answer = client.get(PARKED)
    assert answer.status_code == 200, answer.content
    assert [r["model"] for r in answer.json()["unplaceable"]] == ["now-refused"]
    page = client.get("/fleet/placement/")
    assert page.status_code == 200 and b"now-refused" in page.content and b"fits nowhere" in page.content


# --- dry runs: the owner among the caller's scopes --------------------------------------------------

@pytest.mark.parametrize("written", ["acme", "acme/ml/search", "org:acme", "project:acme/ml/search", "ACME/ML/"])
def test_a_dry_run_for_another_orgs_scope_is_404_and_tells_none_of_its_figures(client, personas, h100_node, written):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=1)
    client.force_login(personas.oscar)
    for url in (EXPLAIN, HEADROOM):
        response = post(client, url, shape(owner=written))
        assert response.status_code == 404, response.content
        assert response.json()["error"]["code"] == "scope_not_found"
        assert b"limit" not in response.content and b"held" not in response.content
    assert not PlacementDecision.objects.exists()  # nothing ran, nothing recorded


def test_an_unknown_owner_reads_exactly_like_one_out_of_reach(client, personas, h100_node):
    client.force_login(personas.oscar)
    unknown = post(client, EXPLAIN, shape(owner="initech"))
    hidden = post(client, EXPLAIN, shape(owner="acme"))
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (hidden.status_code,
                                                                       hidden.json()["error"]["code"])
    by_id = post(client, EXPLAIN, shape(owner=str(personas.acme.org.public_id)))
    assert by_id.status_code == 404 and str(personas.acme.org.public_id).encode() in by_id.content  # as written


def test_a_dry_run_for_a_scope_one_sees_counts_the_limits_that_bind_it(client, personas, h100_node):
    # The limits above a scope bind it, so whoever sees the scope sees them (tenancy's contract chain).
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=1)
    client.force_login(personas.max)
    explain = post(client, EXPLAIN, shape(owner="acme/ml/search"))
    assert explain.status_code == 200, explain.content
    assert explain.json()["pending"]["code"] == "quota" and "org:acme" in explain.json()["pending"]["reason"]
    room = post(client, HEADROOM, shape(owner="project:acme/ml/search"))
    assert room.status_code == 200 and room.json()["more"] == 0 and "GPUs limit" in room.json()["blocked"]
    shared = post(client, HEADROOM, shape(owner=""))
    # Counted against nobody: as many 2-way replicas as the six GPUs with room take, one replica of
    # a model per GPU (one pair is the pending launch).
    assert shared.status_code == 200 and shared.json()["more"] == 2
    owners = set(PlacementDecision.objects.values_list("owner__path", flat=True))
    assert owners == {"acme/ml/search", None}


# --- decisions: read by those who see the model's owner ---------------------------------------------

def test_each_tenant_lists_only_decisions_about_its_own_models(client, tenants_decided, staff):
    people = tenants_decided
    expected = {people.oscar: {"globex-secret-llm"}, people.olivia: {"acme-search-llm"},
                people.max: {"acme-search-llm"}, people.vera: {"acme-search-llm"},
                staff: {"acme-search-llm", "globex-secret-llm", "shared-llm"}}
    for user, models in expected.items():
        client.force_login(user)
        response = client.get(DECISIONS)
        assert response.status_code == 200
        assert {r["model"] for r in results(response)} == models, user.username
    client.force_login(people.oscar)
    assert b"acme" not in client.get(DECISIONS).content


def test_another_tenants_decision_by_id_is_404(client, tenants_decided):
    acme_row = PlacementDecision.objects.filter(model="acme-search-llm").first()
    client.force_login(tenants_decided.oscar)
    response = client.get(f"{DECISIONS}{acme_row.public_id}/")
    assert response.status_code == 404 and b"acme" not in response.content
    client.force_login(tenants_decided.vera)
    assert client.get(f"{DECISIONS}{acme_row.public_id}/").status_code == 200


def test_parked_and_unplaceable_lists_and_the_placement_page_are_narrowed_too(client, tenants_decided, staff):
    from scheduler import recovery_service

    recovery_service.note_failure("acme-search-llm", "oom", "CUDA out of memory at acme", fallback=False)
    for _ in range(5):
        recovery_service.note_failure("acme-search-llm", "oom", "CUDA out of memory at acme", fallback=False)
    client.force_login(tenants_decided.oscar)
    lists = client.get(PARKED).json()
    assert [r["model"] for r in lists["unplaceable"]] == ["globex-secret-llm"] and lists["parked"] == []
    page = client.get("/fleet/placement/")
    assert page.status_code == 200 and b"globex-secret-llm" in page.content and b"acme" not in page.content
    client.force_login(tenants_decided.max)
    lists = client.get(PARKED).json()
    assert [r["model"] for r in lists["parked"]] == ["acme-search-llm"]
    client.force_login(staff)
    lists = client.get(PARKED).json()
    assert {r["model"] for r in lists["unplaceable"]} == {"acme-search-llm", "globex-secret-llm", "shared-llm"}


def test_a_dry_run_is_read_by_those_who_see_its_owner(client, personas, h100_node):
    client.force_login(personas.oscar)
    assert post(client, HEADROOM, shape(owner="globex", name="globex-probe")).status_code == 200
    assert [r["model"] for r in results(client.get(DECISIONS))] == ["globex-probe"]
    client.force_login(personas.olivia)
    assert results(client.get(DECISIONS)) == []


# --- the fleet: capacity for everyone, model files for staff ----------------------------------------

@pytest.fixture
def node_with_files(db):
    return register_node(NodeReport(
        name="files-01", address="127.0.0.1", cpu_count=8, memory_total_bytes=64 * GIB,
        engines=(EngineReport(kind="llamacpp", version="b1"),),
        model_directories=(ModelDirectoryReport("/srv/models", (
            HeldWeightReport("globex-secret/weights.gguf", 10 * GIB, "gguf"),)),)))


def test_members_see_the_fleets_capacity_but_not_its_model_files(client, personas, staff, node_with_files):
    client.force_login(personas.max)
    listing = client.get("/api/scheduler/nodes/")
    assert listing.status_code == 200
    node = results(listing)[0]
    assert node["name"] == "files-01" and node["cpu_count"] == 8 and node["engines"][0]["kind"] == "llamacpp"
    assert "model_directories" not in node
    one = client.get(f"/api/scheduler/nodes/{node_with_files.public_id}/")
    assert one.status_code == 200 and "model_directories" not in one.json()
    for response in (listing, one, client.get(f"/fleet/nodes/{node_with_files.public_id}/"), client.get("/fleet/")):
        assert response.status_code == 200
        assert b"globex-secret" not in response.content and b"/srv/models" not in response.content
    client.force_login(staff)
    one = client.get(f"/api/scheduler/nodes/{node_with_files.public_id}/").json()
    assert one["model_directories"][0]["weights"][0]["path"] == "globex-secret/weights.gguf"
    assert b"globex-secret/weights.gguf" in client.get(f"/fleet/nodes/{node_with_files.public_id}/").content


def test_estimating_a_path_is_for_staff(client, personas, staff, model_root, gguf_model):
    path = gguf_model(layers=4, embedding=256, heads=4, kv_heads=2)
    body = {"model_path": str(path), "engine": "llamacpp"}
    anonymous = post(client, "/api/scheduler/estimate/", body)
    assert anonymous.status_code in (401, 403) and b"layers" not in anonymous.content
    client.force_login(personas.max)
    refused = post(client, "/api/scheduler/estimate/", body)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "fleet_files_for_staff"
    assert b"layers" not in refused.content
    missing = post(client, "/api/scheduler/estimate/", {"model_path": str(model_root / "absent.gguf")})
    assert missing.status_code == 403  # no answer says whether a file exists
    assert client.get("/fleet/estimate/", {"model_path": str(path)}).status_code == 403
    assert b"Will it fit?" not in client.get("/fleet/").content
    client.force_login(staff)
    assert post(client, "/api/scheduler/estimate/", body).status_code == 200
    assert client.get("/fleet/estimate/", {"model_path": str(path), "engine": "llamacpp"}).status_code == 200
