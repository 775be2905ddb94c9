"""The status summary (``serving.control.status.summary``): its figures for a small fleet, the
``manage.py status`` text and ``--json``, and ``GET /api/serving/status/`` narrowed per caller —
a superuser sees every model, acme's owner acme's and the shared ones (never globex's), globex's
owner and management key globex's, a viewer its project's; the fleet's figures are everyone's."""

from __future__ import annotations

import io
import json
import time
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.core.management import call_command
from django.utils import timezone
from rest_framework.test import APIClient

from scheduler.models import Accelerator, MemoryReservation, PlacementDecision, RecoveryState
from scheduler.services import NodeReport, register_node
from serving import load
from serving.api.status import figures
from serving.control import status
from serving.management.commands.status import bar
from serving.models import Deployment, DeploymentEvent, ModelEntry, Replica
from serving.control import watchdog
from tenancy.audit import SYSTEM
from tenancy.services import clients

pytestmark = pytest.mark.django_db
DAY = 24 * 3600


def entry(name, owner, scaling_min=1):
    return ModelEntry.objects.create(name=name, owner=owner, source_kind="local", source_path=f"/models/{name}.gguf",
                                     format="gguf", task="chat", scaling_min=scaling_min,
                                     profiles=[{"name": "cpu", "engine": "llamacpp", "file": f"{name}.gguf"}])


@pytest.fixture
def fleet(personas, settings):
    """gpu-01 (two H100s, one held, memory critical), gpu-02 (one H100, nothing held), cpu-01 (no GPUs);
    acme-two wants 2 and has 1 ready (idle for two days), acme-parked is parked, globex-stuck cannot be
    placed, shared-chat is on demand with nothing running; acme-two's second replica failed from the queue."""
    acme, globex = personas.acme.project, personas.globex.project
    gpu1 = register_node(NodeReport(name="gpu-01", address="127.0.0.1", memory_total_bytes=64 * 2**30,
                                    memory_available_bytes=0))
    gpu2 = register_node(NodeReport(name="gpu-02", address="127.0.0.2", memory_total_bytes=64 * 2**30,
                                    memory_available_bytes=64 * 2**30))
    cpu = register_node(NodeReport(name="cpu-01", address="127.0.0.3"))
    held = Accelerator.objects.create(node=gpu1, index=0, uuid="GPU-a", accelerator_class="H100-80GB",
                                      memory_total_bytes=80 * 2**30)
    Accelerator.objects.create(node=gpu1, index=1, uuid="GPU-b", accelerator_class="H100-80GB",
                               memory_total_bytes=80 * 2**30)
    Accelerator.objects.create(node=gpu2, index=0, uuid="GPU-c", accelerator_class="H100-80GB",
                               memory_total_bytes=80 * 2**30)
    MemoryReservation.objects.create(node=gpu1, accelerator=held, holder="replica:two", bytes=10 * 2**30)
    settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB = 1
    # The cache outlives a test's database (Redis): a level an earlier test left under a reused id goes.
    cache.delete_many([watchdog._level_key(node) for node in (gpu1, gpu2, cpu)])
    watchdog.check(gpu1)  # 0 bytes available: critical, as the agent's telemetry refresh records it
    watchdog.check(gpu2)

    two = entry("acme-two", acme, scaling_min=2)
    entry("acme-parked", acme)
    entry("globex-stuck", globex)
    entry("shared-chat", None, scaling_min=0)
    deployment = Deployment.objects.create(name="acme-two", model_path="/models/acme-two.gguf", node=gpu1,
                                           owner=acme, state="ready", replicas=2)
    ready = Replica.objects.create(deployment=deployment, node=gpu1, port=20001, state="ready",
                                   ready_at=timezone.now() - timedelta(days=2))
    failed = Replica.objects.create(deployment=deployment, node=gpu1, port=20002, state="failed")
    DeploymentEvent.objects.create(deployment=deployment, replica=failed, from_state="queued", to_state="failed",
                                   message="engine exited with 1 before it was ready")
    old = DeploymentEvent.objects.create(deployment=deployment, from_state="starting", to_state="failed",
                                         message="an old failure")
    DeploymentEvent.objects.filter(pk=old.pk).update(at=timezone.now() - timedelta(days=2))
    load.note_used({"acme-two": time.time() - 2 * DAY})
    RecoveryState.objects.create(model="acme-parked", kind="crash", consecutive=5, parked=True,
                                 parked_at=timezone.now(), last_error="crashed five times")
    PlacementDecision.objects.create(model="globex-stuck", owner=globex, verdict="unschedulable",
                                     reason_codes=["no_fit"], detail="no node has 200 GiB free",
                                     inputs_digest="0" * 32, fingerprint="0" * 32)
    return {"two": two, "replica": ready, "gpu1": gpu1}


def names(data):
    return sorted(m["name"] for m in data["models"])


def test_the_figures_for_a_small_fleet(fleet):
    data = figures(SYSTEM)
    assert data["capacity"] == [{"accelerator_class": "H100-80GB", "total": 3, "in_use": 1, "free": 2,
                                 "unavailable": 0, "memory_total_bytes": 240 * 2**30,
                                 "memory_reserved_bytes": 10 * 2**30, "used_percent": 33.3}]
    assert data["free_nodes"] == ["gpu-02"]  # gpu-01 holds a reservation; cpu-01 has no accelerator
    assert {n["name"]: n["watchdog"] for n in data["nodes"]} == {"cpu-01": None, "gpu-01": "critical",
                                                                "gpu-02": "ok"}
    models = {m["name"]: m for m in data["models"]}
    assert names(data) == ["acme-parked", "acme-two", "globex-stuck", "shared-chat"]
    assert (models["acme-two"]["ready"], models["acme-two"]["wanted"], models["acme-two"]["satisfied"]) == (1, 2, False)
    assert models["acme-two"]["nodes"] == ["gpu-01"]
    assert (models["acme-parked"]["state"], models["acme-parked"]["satisfied"]) == ("parked", False)
    assert (models["globex-stuck"]["state"], models["globex-stuck"]["satisfied"]) == ("unplaceable", False)
    assert (models["shared-chat"]["state"], models["shared-chat"]["satisfied"]) == ("idle", True)
    assert data["satisfied"] == {"satisfied": 1, "total": 4}
    assert data["parked"] == [{"name": "acme-parked",
                               "reason": "parked after 5 failure(s) in a row: crashed five times"}]
    assert data["unplaceable"] == [{"name": "globex-stuck", "reason": "no node has 200 GiB free"}]
    [idle] = data["idle_replicas"]
    assert (idle["model"], idle["replica"], idle["node"]) == ("acme-two", str(fleet["replica"].public_id), "gpu-01")
    assert idle["idle_seconds"] >= 2 * DAY - 60
    # The queued replica's failure is listed; the one two days old is not.
    assert [(f["deployment"], f["from_state"], f["message"]) for f in data["failures"]] == [
        ("acme-two", "queued", "engine exited with 1 before it was ready")]
    json.dumps(data)  # plain data, as the API and --json write it


def test_parked_never_counts_as_satisfied_even_with_every_replica_up(fleet):
    two = fleet["two"]
    RecoveryState.objects.create(model="acme-two", kind="oom", consecutive=3, parked=True, parked_at=timezone.now())
    Deployment.objects.filter(name="acme-two").update(replicas=1)
    ModelEntry.objects.filter(pk=two.pk).update(scaling_min=1)
    models = {m["name"]: m for m in figures(SYSTEM)["models"]}
    assert (models["acme-two"]["ready"], models["acme-two"]["wanted"]) == (1, 1)
    assert (models["acme-two"]["state"], models["acme-two"]["satisfied"]) == ("parked", False)
    assert models["acme-two"]["reason"].startswith("parked after 3 failure(s) in a row")


def test_an_unplaceable_verdict_a_model_has_outgrown_is_not_listed(fleet, personas):
    deployment = Deployment.objects.create(name="globex-stuck", model_path="/models/globex-stuck.gguf",
                                           node=fleet["gpu1"], owner=personas.globex.project, state="ready")
    Replica.objects.create(deployment=deployment, node=fleet["gpu1"], port=20003, state="ready")
    data = figures(SYSTEM)
    models = {m["name"]: m for m in data["models"]}
    assert (models["globex-stuck"]["state"], models["globex-stuck"]["satisfied"]) == ("serving", True)
    assert data["unplaceable"] == []


def test_a_model_used_recently_or_not_known_is_not_idle(fleet):
    load.note_used({"acme-two": time.time() - 60})
    assert figures(SYSTEM)["idle_replicas"] == []
    # Not known (no use recorded since a restart) is not idle, and reading the status records nothing.
    cache.delete("berth:ondemand:last-used:acme-two")
    assert figures(SYSTEM)["idle_replicas"] == []
    assert cache.get("berth:ondemand:last-used:acme-two") is None


def test_levels_not_known_are_null_not_ok(fleet):
    data = status.summary(SYSTEM, levels=lambda nodes: None)
    assert {n["watchdog"] for n in data["nodes"]} == {None}
    assert {n["watchdog"] for n in status.summary(SYSTEM)["nodes"]} == {None}


def test_the_usage_bar():
    assert bar(0, 4, width=8) == "[--------]"
    assert bar(1, 3, width=6) == "[##----]"
    assert bar(1, 100, width=10) == "[#---------]"  # any use shows
    assert bar(4, 4, width=4) == "[####]"
    assert bar(0, 0, width=4) == "[----]"


def test_the_command_prints_the_figures(fleet):
    out = io.StringIO()
    call_command("status", stdout=out)
    text = out.getvalue()
    assert "H100-80GB" in text and f"{bar(1, 3)} 1/3 in use, 2 free" in text
    assert "Free whole nodes: gpu-02" in text
    assert "gpu-01" in text and "memory critical" in text and "memory not known" in text
    assert "Models satisfied: 1/4" in text
    assert "acme-two: 1/2 ready" in text
    assert "Parked: 1\n  acme-parked: parked after 5 failure(s) in a row: crashed five times" in text
    assert "globex-stuck: no node has 200 GiB free" in text
    assert "Unused for a day: 1" in text and "acme-two on gpu-01 (ready), idle 48 h" in text
    assert "Failures (24 h): 1" in text and "engine exited with 1 before it was ready" in text
    assert "an old failure" not in text


def test_the_command_writes_json_and_narrows_to_a_user(fleet, personas):
    out = io.StringIO()
    call_command("status", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert names(data) == ["acme-parked", "acme-two", "globex-stuck", "shared-chat"]
    assert data["satisfied"] == {"satisfied": 1, "total": 4}
    out = io.StringIO()
    call_command("status", "--json", "--user", "oscar", stdout=out)
    assert names(json.loads(out.getvalue())) == ["globex-stuck", "shared-chat"]
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="no active user 'nobody'"):
        call_command("status", "--user", "nobody", stdout=io.StringIO())


def api(user=None, key=None):
    client = APIClient()
    if key:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    elif user is not None:
        client.force_login(user)
    return client.get("/api/serving/status/", HTTP_ACCEPT="application/json")


def test_the_api_as_a_superuser_sees_every_model(fleet, admin_user):
    response = api(admin_user)
    assert response.status_code == 200
    data = response.json()
    assert names(data) == ["acme-parked", "acme-two", "globex-stuck", "shared-chat"]
    assert data == json.loads(json.dumps(figures(admin_user)))  # the command's figures, the same function


def test_the_api_as_acmes_owner_sees_acme_and_shared_never_globex(fleet, personas):
    response = api(personas.olivia)
    assert response.status_code == 200
    data = response.json()
    assert names(data) == ["acme-parked", "acme-two", "shared-chat"]
    assert data["unplaceable"] == [] and [p["name"] for p in data["parked"]] == ["acme-parked"]
    assert "globex" not in response.content.decode()
    # The fleet's figures are everyone's.
    assert data["capacity"][0]["total"] == 3 and data["free_nodes"] == ["gpu-02"]
    assert data["failures"][0]["deployment"] == "acme-two" and len(data["idle_replicas"]) == 1


def test_the_api_as_globexs_owner_sees_nothing_of_acme(fleet, personas):
    response = api(personas.oscar)
    assert response.status_code == 200
    data = response.json()
    assert names(data) == ["globex-stuck", "shared-chat"]
    assert [u["name"] for u in data["unplaceable"]] == ["globex-stuck"]
    assert data["parked"] == [] and data["idle_replicas"] == [] and data["failures"] == []
    assert "acme" not in response.content.decode()
    assert data["capacity"][0]["in_use"] == 1  # the fleet's use, with no holder named


def test_the_api_as_a_viewer_sees_their_project(fleet, personas):
    response = api(personas.vera)
    assert response.status_code == 200
    assert names(response.json()) == ["acme-parked", "acme-two", "shared-chat"]
    assert "globex" not in response.content.decode()


def test_a_management_key_sees_its_scope(fleet, personas):
    client = clients.create_client(personas.oscar_actor, personas.globex.project, "status-robot", access="management")
    _, secret = clients.create_credential(personas.oscar_actor, client, name="status")
    response = api(key=secret)
    assert response.status_code == 200
    assert names(response.json()) == ["globex-stuck", "shared-chat"]
    assert "acme" not in response.content.decode()


def test_the_api_refuses_anonymous_callers(fleet):
    assert api().status_code in (401, 403)
    assert "acme" not in api().content.decode()
