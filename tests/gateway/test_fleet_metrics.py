"""The fleet's series on /metrics (gateway.fleet_metrics), read from rows made here: a parked model,
an unplaceable one, one ready 0 of 1, a node with a GPU of a class, a scope with a contract. Each
series is checked by its labels and value; an unmeasured sensor is absent; no client string
becomes a label. The GenAI duplicates of the gateway's series are checked beside their originals."""

import time
from decimal import Decimal

import pytest
from django.core.cache import cache
from prometheus_client.parser import text_string_to_metric_families

from berth import health
from gateway import fleet_metrics, metrics
from scheduler.models import Accelerator, MemoryReservation, Node, PlacementDecision, RecoveryState
from serving import load
from serving.models import Deployment, ModelEntry, Replica

pytestmark = pytest.mark.django_db

CLIENT_STRINGS = ("client-asked-this", "replica:client-holder", "not-in-catalog")


def samples(text: bytes) -> dict:
    """{(sample name, frozenset of labels): value} of an exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def value(found, name, **labels):
    return found.get((name, frozenset(labels.items())))


def names_of(found, name):
    return {dict(labels).get("model") for sample, labels in found if sample == name}


def entry(name, **fields):
    fields.setdefault("source_kind", "local")
    fields.setdefault("format", "gguf")
    return ModelEntry.objects.create(name=name, **fields)


def decision(model, verdict, **fields):
    return PlacementDecision.objects.create(model=model, verdict=verdict, kind=PlacementDecision.Kind.PLAN,
                                            inputs_digest="d", fingerprint="f", **fields)


@pytest.fixture
def fleet(db):
    from tenancy.audit import Actor
    from tenancy.models import Contract, Reservation
    from tenancy.services.tree import create_scope

    cache.delete_many([health.LAST_PASS_KEY, health.PASS_LOCK_KEY])
    node = Node.objects.create(name="gpu-a", address="127.0.0.1")
    Node.objects.create(name="gpu-b", address="127.0.0.1", state=Node.State.LOST)
    held = Accelerator.objects.create(node=node, index=0, uuid="GPU-0", accelerator_class="H200",
                                      temperature_c=61.0, power_watts=300.0, memory_used_bytes=4 << 30)
    Accelerator.objects.create(node=node, index=1, uuid="GPU-1", accelerator_class="H200")  # nothing measured
    Accelerator.objects.create(node=node, index=2, uuid="GPU-2", accelerator_class="H200", placeable=False)
    MemoryReservation.objects.create(node=node, accelerator=held, holder="replica:client-holder", bytes=8 << 30)

    entry("parked-model", scaling_min=1, fingerprint="fp1")
    RecoveryState.objects.create(model="parked-model", consecutive=5, parked=True, parked_fingerprint="fp1",
                                 kind="crash")
    entry("unplaceable-model", scaling_min=1)
    decision("unplaceable-model", PlacementDecision.Verdict.PLACED)
    decision("unplaceable-model", PlacementDecision.Verdict.UNSCHEDULABLE)  # the latest counts
    entry("starved-model", scaling_min=1)  # should run, nothing ready
    RecoveryState.objects.create(model="starved-model", consecutive=2, kind="oom")
    decision("starved-model", PlacementDecision.Verdict.PREEMPTED)
    decision("starved-model", PlacementDecision.Verdict.PREEMPTED)
    served = entry("served-model", scaling_min=0, pinned=True)
    deployment = Deployment.objects.create(name=served.name, model_path="/m.gguf", node=node, state="ready")
    Replica.objects.create(deployment=deployment, node=node, port=9001, state="ready")
    Replica.objects.create(deployment=deployment, node=node, port=9002, state="loading")
    load.note_used({"served-model": time.time() - 120})

    # Strings that are not catalog names and must never become labels.
    stray = Deployment.objects.create(name="client-asked-this", model_path="/x.gguf", node=node, state="ready")
    Replica.objects.create(deployment=stray, node=node, port=9003, state="ready")
    RecoveryState.objects.create(model="not-in-catalog", consecutive=9, parked=True)
    decision("not-in-catalog", PlacementDecision.Verdict.UNSCHEDULABLE)

    actor = Actor(system="tests")
    org = create_scope(actor, "org", "fleetorg", "Org")
    team = create_scope(actor, "team", "ml", "ML", org)
    Contract.objects.create(scope=org, gpus_guarantee=Decimal(2), gpus_limit=Decimal(4))
    Reservation.objects.create(scope=team, scope_path=team.path, holder="replica:r1", gpus=Decimal(1), gpu_memory_gib=Decimal(20))
    Reservation.objects.create(scope=org, scope_path=org.path, holder="replica:r2", gpus=Decimal("0.5"))
    yield org
    cache.delete_many([load._used_key("served-model"), health.LAST_PASS_KEY])


def test_the_preempted_counter_never_goes_down_when_the_history_is_trimmed(fleet, settings):
    from scheduler import placement_service
    from scheduler.models import DecisionTally

    before = value(samples(fleet_metrics.render()), "berth_model_preempted_total", model="starved-model")
    settings.SCHEDULER_DECISION_HISTORY = 3
    for _ in range(5):  # the newest three stay; the two preemptions and the oldest of these go
        decision("served-model", PlacementDecision.Verdict.PLACED)
    decision("starved-model", PlacementDecision.Verdict.PREEMPTED)
    assert placement_service.trim_history() > 0
    assert PlacementDecision.objects.filter(model="starved-model", verdict="preempted").count() == 1  # the new one
    assert DecisionTally.objects.get(model="starved-model", verdict="preempted").count == 2
    after = value(samples(fleet_metrics.render()), "berth_model_preempted_total", model="starved-model")
    assert (before, after) == (2, 3)  # two tallied, one kept: nothing lost, no fall Prometheus would call a reset


def test_model_series(fleet):
    found = samples(fleet_metrics.render())
    assert value(found, "berth_fleet_metrics_up") == 1
    for model, desired, ready in (("parked-model", 1, 0), ("unplaceable-model", 1, 0), ("starved-model", 1, 0),
                                  ("served-model", 1, 1)):
        assert value(found, "berth_model_desired_replicas", model=model) == desired
        assert value(found, "berth_model_ready_replicas", model=model) == ready  # 0 published, not absent
    assert value(found, "berth_model_parked", model="parked-model") == 1
    assert value(found, "berth_model_parked", model="starved-model") == 0
    assert value(found, "berth_model_start_failures", model="parked-model") == 5
    assert value(found, "berth_model_start_failures", model="starved-model") == 2
    assert value(found, "berth_model_start_failures", model="served-model") == 0
    assert value(found, "berth_model_unplaceable", model="unplaceable-model") == 1
    assert value(found, "berth_model_unplaceable", model="parked-model") == 0
    assert value(found, "berth_model_preempted_total", model="starved-model") == 2
    assert value(found, "berth_model_preempted_total", model="served-model") == 0
    assert 115 <= value(found, "berth_model_idle_seconds", model="served-model") < 200
    assert names_of(found, "berth_model_idle_seconds") == {"served-model"}  # absent when not known


def test_a_parked_model_whose_definition_changed_is_not_parked(fleet):
    ModelEntry.objects.filter(name="parked-model").update(fingerprint="fp2")
    assert value(samples(fleet_metrics.render()), "berth_model_parked", model="parked-model") == 0


def test_node_series(fleet):
    found = samples(fleet_metrics.render())
    for state in Node.State.values:
        assert value(found, "berth_node_state", node="gpu-a", state=state) == int(state == "ready")
        assert value(found, "berth_node_state", node="gpu-b", state=state) == int(state == "lost")
    assert value(found, "berth_node_accelerators", node="gpu-a", accelerator_class="H200") == 3
    assert value(found, "berth_node_accelerators_free", node="gpu-a", accelerator_class="H200") == 1
    assert value(found, "berth_node_memory_reserved_bytes", node="gpu-a") == 8 << 30
    assert value(found, "berth_node_accelerator_memory_measured_bytes", node="gpu-a") == 4 << 30
    assert value(found, "berth_node_accelerator_memory_measured_bytes", node="gpu-b") is None
    gpu0 = {"node": "gpu-a", "accelerator": "0", "accelerator_class": "H200"}
    assert value(found, "berth_accelerator_temperature_celsius", **gpu0) == 61.0
    assert value(found, "berth_accelerator_power_watts", **gpu0) == 300.0
    assert value(found, "berth_accelerator_utilisation_percent", **gpu0) is None  # not measured: absent
    sensors = [name for name, _, _ in fleet_metrics.SENSORS]
    for (name, labels) in found:
        if name in sensors:
            assert dict(labels)["accelerator"] == "0"  # GPU 1 and 2 measured nothing: no series at all, never 0


def test_scope_series(fleet):
    found = samples(fleet_metrics.render())
    org = fleet.path
    assert value(found, "berth_scope_holdings", scope=org, resource="gpus") == 1.5  # the team's counts too
    assert value(found, "berth_scope_holdings", scope=org, resource="gpu_memory_gib") == 20
    assert value(found, "berth_scope_guarantee", scope=org, resource="gpus") == 2
    assert value(found, "berth_scope_limit", scope=org, resource="gpus") == 4
    assert value(found, "berth_scope_limit", scope=org, resource="cores") is None  # unset: absent


def test_control_loop_series(fleet):
    assert value(samples(fleet_metrics.render()), "berth_control_last_pass_timestamp_seconds") is None
    cache.set(health.LAST_PASS_KEY, 1_800_000_000.0, None)
    found = samples(fleet_metrics.render())
    assert value(found, "berth_control_last_pass_timestamp_seconds") == 1_800_000_000.0
    assert value(found, "berth_control_pass_running") == 0


def test_no_client_string_is_a_label(fleet):
    text = fleet_metrics.render().decode()
    for stray in CLIENT_STRINGS:
        assert stray not in text
    labels = {key for family in text_string_to_metric_families(text) for s in family.samples for key in s.labels}
    assert labels <= {"model", "node", "state", "accelerator", "accelerator_class", "scope", "resource", "holder"}


def test_a_database_outage_leaves_the_gateway_series(fleet, monkeypatch):
    def broken():
        raise RuntimeError("database gone")
    monkeypatch.setattr(fleet_metrics, "node_families", broken)
    found = samples(fleet_metrics.render())
    assert value(found, "berth_fleet_metrics_up") == 0
    assert not any(name.startswith("berth_model_") for name, _ in found)


def test_the_gateway_series_also_under_the_genai_names(db):
    metrics.LATENCY.labels("genai-m", "chat").observe(0.2)
    metrics.TTFT.labels("genai-m").observe(0.05)
    metrics.TOKENS.labels("genai-m", "prompt").inc(7)
    metrics.TOKENS.labels("genai-m", "completion").inc(3)
    found = samples(metrics.render())
    model = {"gen_ai_request_model": "genai-m"}
    assert value(found, "gen_ai_server_request_duration_count", gen_ai_operation_name="chat", **model) == \
        value(found, "berth_gateway_request_seconds_count", model="genai-m", endpoint="chat")
    assert value(found, "gen_ai_server_request_duration_bucket", gen_ai_operation_name="chat", le="0.25", **model) \
        == value(found, "berth_gateway_request_seconds_bucket", model="genai-m", endpoint="chat", le="0.25")
    assert value(found, "gen_ai_server_time_to_first_token_sum", **model) == \
        value(found, "berth_gateway_first_token_seconds_sum", model="genai-m")
    assert value(found, "gen_ai_client_token_usage_total", gen_ai_token_type="input", **model) == \
        value(found, "berth_gateway_tokens_total", model="genai-m", kind="prompt")
    assert value(found, "gen_ai_client_token_usage_total", gen_ai_token_type="output", **model) == \
        value(found, "berth_gateway_tokens_total", model="genai-m", kind="completion")
    assert value(found, "berth_gateway_tokens_total", model="genai-m", kind="prompt") >= 7  # originals kept


@pytest.mark.django_db(transaction=True)
def test_the_gateway_process_answers_the_fleet_series_on_metrics(gateway):
    """The real gateway process (uvicorn, loopback scrape): its own series and the fleet's, read
    from the rows on its database threads, in one page."""
    import httpx

    entry("scraped-model", scaling_min=1)
    Node.objects.create(name="scraped-node", address="127.0.0.1")
    answer = httpx.get(f"{gateway.base_url}/metrics", timeout=10)
    assert answer.status_code == 200
    found = samples(answer.content)
    assert value(found, "berth_fleet_metrics_up") == 1
    assert value(found, "berth_model_ready_replicas", model="scraped-model") == 0
    assert value(found, "berth_model_desired_replicas", model="scraped-model") == 1
    assert value(found, "berth_node_state", node="scraped-node", state="ready") == 1
    assert "# TYPE berth_gateway_requests_total counter" in answer.text  # the gateway's own series, first
    assert "# TYPE gen_ai_server_request_duration histogram" in answer.text


def test_backup_age_is_absent_until_an_archive_exists(fleet, settings, tmp_path):
    from datetime import UTC, datetime, timedelta

    from berth import backup

    settings.BACKUP_DIR = tmp_path
    assert value(samples(fleet_metrics.render()), "berth_backup_age_seconds") is None
    (tmp_path / "notes.txt").write_text("not an archive")
    assert value(samples(fleet_metrics.render()), "berth_backup_age_seconds") is None
    made = datetime.now(UTC) - timedelta(hours=1)
    (tmp_path / f"{backup.PREFIX}{made:%Y%m%dT%H%M%S%f}Z{backup.SUFFIX}").write_bytes(b"")
    assert 3590 <= value(samples(fleet_metrics.render()), "berth_backup_age_seconds") < 3700
