"""Recovery and parking with effects: failed launches climb the ladder in the recovery table, the
policy reads them back as ``Snapshot.failures``, an operator retries a parked model through the API
or the console, and everything that lists parked models says why."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest
from django.db import connection

from scheduler import recovery_service
from scheduler.errors import ModelNotParked
from scheduler.models import PlacementDecision, RecoveryState
from scheduler.placement_service import parked_and_unplaceable, record_plan
from scheduler.policy import recovery
from scheduler.policy.inputs import GIB, DesiredModel, NodeInfo, Profile, Snapshot
from scheduler.policy.plan import schedule
from tenancy.audit import SYSTEM, Actor
from tenancy.models import AuditEvent, Membership, Role, Scope

pytestmark = pytest.mark.django_db
OPERATOR = Actor(system="tests")


def llm(mid="llama-8b", fingerprint="fp-1", fallbacks=()):
    return DesiredModel(mid, (Profile("default", "llamacpp", 0, 4 * GIB, cpu_cores=2),), fingerprint=fingerprint,
                        fallbacks=fallbacks)


def step(model: DesiredModel):
    return recovery.next_step(model, recovery_service.failure_states().get(model.id))


def fail(kind, times=1, model="llama-8b", fingerprint="fp-1", error="engine exited with status 1 while loading",
         fallback=False):
    for _ in range(times):
        row = recovery_service.note_failure(model, kind, error, fingerprint, fallback=fallback)
    return row


@pytest.fixture
def member(django_user_model):
    return django_user_model.objects.create_user("bo", "bo@example.org", "pw-not-staff-123")


# --- the ladder, kept in the table -----------------------------------------------------------------

def test_a_crash_is_retried_with_backoff_four_times_then_parked_at_the_fifth(caplog):
    for count in (1, 2, 3, 4):
        row = fail("crash")
        assert (row.consecutive, row.parked) == (count, False)
        answer = step(llm())
        assert answer.action == recovery.RETRY and not answer.parked
        assert answer.not_before == pytest.approx(row.last_failure_at.timestamp() + recovery.backoff(count))
    with caplog.at_level(logging.WARNING, logger="scheduler.recovery_service"):
        row = fail("crash")
    # After 5 consecutive failures the model is parked (crash_retries = 4, park_after = 5).
    assert row.parked and row.consecutive == 5 and row.parked_at is not None and row.parked_fingerprint == "fp-1"
    assert "llama-8b parked after 5 launch failure(s)" in caplog.text
    assert step(llm()).parked
    assert not step(llm(fingerprint="fp-2")).parked  # a new definition is not parked
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="scheduler.recovery_service"):
        again = fail("crash")
    assert again.parked and again.parked_at == row.parked_at and "parked" not in caplog.text  # logged once


def test_out_of_memory_degrades_then_falls_back_then_quarantines():
    fail("oom", error="engine out of memory (Docker OOMKilled) while loading", fallback=True)
    first = step(llm(fallbacks=("llama-1b",)))
    assert (first.action, first.level, first.fallback) == (recovery.DEGRADE, 1, False)
    row = fail("oom", fallback=True)
    assert not row.parked
    second = step(llm(fallbacks=("llama-1b",)))
    assert (second.action, second.fallback, second.level) == (recovery.FALLBACK, True, 1)  # the fallback, degraded
    minimal = step(llm())  # no fallback configured: the last rung, the minimal footprint, instead
    assert (minimal.action, minimal.level, minimal.parked) == (recovery.MINIMAL, 2, False)
    row = fail("oom", fallback=True)
    assert row.parked and row.consecutive == 3 and row.level == 1 and row.kind == "oom"


def test_a_hang_gets_one_retry_then_degrades():
    fail("hang", error="not ready within 900s")
    assert step(llm()).action == recovery.RETRY
    fail("hang")
    assert (step(llm()).action, step(llm()).level) == (recovery.DEGRADE, 1)


def test_a_ready_replica_resets_the_memory_and_a_new_definition_starts_a_fresh_ladder():
    fail("crash", times=2)
    assert recovery_service.note_success("llama-8b") is True
    assert recovery_service.failure_states() == {}
    assert recovery_service.note_success("llama-8b") is False  # nothing left to forget: no write
    assert recovery_service.note_success("never-failed") is False and not RecoveryState.objects.filter(
        model="never-failed").exists()
    fail("crash", times=5)
    row = fail("crash", fingerprint="fp-2")  # the catalog entry changed since it was parked
    assert (row.consecutive, row.parked, row.fingerprint) == (1, False, "fp-2")


def test_the_policy_parks_what_the_table_says_and_the_plan_records_why():
    fail("crash", times=5)
    snap = Snapshot(now=time.time(), models=(llm(), llm("healthy", fingerprint="fp-h")),
                    failures=recovery_service.failure_states())
    plan = schedule(snap)
    parked = next(d for d in plan.decisions if d.model == "llama-8b")
    assert parked.verdict == "parked" and "parked after 5 failures" in parked.detail
    assert not any(d.model == "healthy" and d.verdict == "parked" for d in plan.decisions)


def test_with_no_fallback_the_minimal_footprint_is_tried_once_then_the_row_parks_and_the_plan_agrees():
    fail("oom", error="out of memory while loading")
    row = fail("oom", error="out of memory while loading")  # a fallback is next, but none is configured
    assert not row.parked and row.level == recovery.MINIMAL_FOOTPRINT
    assert (step(llm()).action, step(llm()).level) == (recovery.MINIMAL, 2)
    row = fail("oom", error="out of memory while loading")  # the minimal footprint failed too
    assert row.parked and row.consecutive == 3 and row.parked_at is not None
    snap = Snapshot(now=time.time(), models=(llm(),), failures=recovery_service.failure_states())
    plan = schedule(snap)
    record_plan(snap, plan)
    assert [(d.model, d.verdict) for d in plan.decisions] == [("llama-8b", "parked")]
    [listed] = recovery_service.parked()
    assert listed["model"] == "llama-8b" and listed["parked"] and "out of memory while loading" in listed["detail"]
    assert [p["model"] for p in parked_and_unplaceable(SYSTEM)["parked"]] == ["llama-8b"]
    recovery_service.retry(OPERATOR, "llama-8b")
    assert recovery_service.parked() == [] and parked_and_unplaceable(SYSTEM)["parked"] == []


def test_a_fallback_that_is_not_in_the_catalog_is_no_fallback():
    fail("oom", times=2, fallback=True)  # the agent found the fallback then; it has since been removed
    snap = Snapshot(now=time.time(), models=(llm(fallbacks=("gone",)),), failures=recovery_service.failure_states())
    answer = recovery.next_step(snap.models[0], snap.failures["llama-8b"], known={"llama-8b"})
    assert (answer.action, answer.level, answer.fallback) == (recovery.MINIMAL, 2, False)  # no fallback's rung
    small = DesiredModel("llama-1b", (Profile("default", "llamacpp", 0, 1 * GIB, cpu_cores=1),), fingerprint="fp-s")
    node = NodeInfo("cpu-1", engines=frozenset({"llamacpp"}), cpu_count=8, memory_bytes=32 * GIB)
    later = time.time() + 3600  # past the backoff
    snap = dataclasses.replace(snap, now=later, nodes=(node,), models=(llm(fallbacks=("gone", "llama-1b")), small))
    launches = {(launch.model, launch.serves_for) for launch in schedule(snap).launches}
    assert ("llama-8b", "llama-1b") in launches


def test_retry_resets_the_row_keeps_who_and_writes_an_audit_event():
    fail("crash", times=5, error="could not start: exec format error")
    row = recovery_service.retry(OPERATOR, "llama-8b")
    assert (row.consecutive, row.parked, row.kind, row.retried_by) == (0, False, "", "system:tests")
    assert row.last_error == "could not start: exec format error"  # the history stays readable
    assert recovery_service.failure_states() == {}
    event = AuditEvent.objects.get(action="placement.retry")
    assert event.details["model"] == "llama-8b" and event.details["was"]["consecutive"] == 5
    with pytest.raises(ModelNotParked):
        recovery_service.retry(OPERATOR, "llama-8b")  # no longer parked
    with pytest.raises(ModelNotParked):
        recovery_service.retry(OPERATOR, "unknown")


def test_unknown_failure_kinds_are_refused():
    with pytest.raises(ValueError):
        recovery_service.note_failure("llama-8b", "sad")


@pytest.mark.django_db(transaction=True)
def test_concurrent_failures_are_all_counted():
    """Agents on several nodes fail replicas of one model at once: the row lock loses no count."""
    RecoveryState.objects.create(model="llama-8b")
    start = threading.Barrier(8)
    errors = []

    def one():
        try:
            start.wait()
            recovery_service.note_failure("llama-8b", "crash", "boom", "fp-1")
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert RecoveryState.objects.get().consecutive == 8


# --- the API -----------------------------------------------------------------------------------------

def test_api_lists_parked_models_with_kind_count_error_and_since(client, admin_user):
    fail("crash", times=5, error="engine exited with status 1 while loading")
    fail("hang", model="other")  # failing, not parked: not listed
    client.force_login(admin_user)
    answer = client.get("/api/scheduler/placement/parked/").json()
    [parked] = answer["parked"]
    assert parked["model"] == "llama-8b" and parked["kind"] == "crash" and parked["consecutive"] == 5
    assert parked["last_error"] == "engine exited with status 1 while loading" and parked["since"]
    assert "parked after 5 failure(s)" in parked["detail"] and parked["retriable"] is True
    assert answer["unplaceable"] == []


def test_staff_retries_a_parked_model_through_the_api(client, admin_user):
    fail("crash", times=5, model="acme/llama-8b")  # a catalog name may hold a slash
    client.force_login(admin_user)
    response = client.post("/api/scheduler/placement/parked/acme/llama-8b/retry/")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["model"] == "acme/llama-8b" and body["parked"] is False and body["consecutive"] == 0
    assert body["retried_by"] == "user:ada" and body["retried_at"]
    assert AuditEvent.objects.get(action="placement.retry").actor == "user:ada"
    assert client.get("/api/scheduler/placement/parked/").json()["parked"] == []


@pytest.mark.parametrize("model", ["never-failed", "only-failing"])
def test_retrying_a_model_that_is_not_parked_is_a_404_with_its_code(client, admin_user, model):
    fail("crash", model="only-failing")
    client.force_login(admin_user)
    response = client.post(f"/api/scheduler/placement/parked/{model}/retry/")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_parked"
    assert not AuditEvent.objects.exists()


def test_non_staff_cannot_retry(client, member):
    fail("crash", times=5)
    client.force_login(member)
    response = client.post("/api/scheduler/placement/parked/llama-8b/retry/")
    assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"
    assert RecoveryState.objects.get().parked


def test_the_schema_documents_the_parked_list_and_retry(client, admin_user):
    client.force_login(admin_user)
    paths = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]
    retry = paths["/api/scheduler/placement/parked/{model}/retry/"]["post"]
    assert set(retry["responses"]) >= {"200", "404"}
    listed = paths["/api/scheduler/placement/parked/"]["get"]["responses"]["200"]
    assert "ParkedAndUnplaceable" in str(listed)


# --- the console -------------------------------------------------------------------------------------

def test_console_shows_a_parked_model_with_why_and_a_retry_button_for_staff(client, admin_user, member):
    fail("crash", times=5, error="engine exited with status 1 while loading")
    client.force_login(admin_user)
    page = client.get("/fleet/placement/").content.decode()
    assert "llama-8b" in page and "parked after 5 failure(s)" in page and "crash" in page
    assert 'hx-post="/fleet/placement/parked/llama-8b/retry/"' in page and ">Retry</button>" in page
    client.force_login(member)
    assert "llama-8b" not in client.get("/fleet/placement/").content.decode()  # of no scope they see
    scope = Scope.objects.create(kind="org", slug="acme", name="Acme", path="acme")
    Membership.objects.create(user=member, scope=scope, role=Role.MEMBER)
    PlacementDecision.objects.create(model="llama-8b", owner=scope, verdict="parked", inputs_digest="d",
                                     fingerprint="f")
    page = client.get("/fleet/placement/").content.decode()
    assert "parked after 5 failure(s)" in page and ">Retry</button>" not in page


def test_console_retry_answers_htmx_with_the_refreshed_lists(client, admin_user):
    fail("crash", times=5)
    client.force_login(admin_user)
    response = client.post("/fleet/placement/parked/llama-8b/retry/", HTTP_HX_REQUEST="true",
                           HTTP_HX_CURRENT_URL="http://testserver/fleet/placement/?verdict=parked")
    fragment = response.content.decode()
    assert response.status_code == 200 and "<html" not in fragment
    assert "llama-8b will be placed again" in fragment and "No parked model." in fragment
    assert 'hx-get="/fleet/placement/?verdict=parked"' in fragment  # it keeps polling the page, not the POST
    assert not RecoveryState.objects.get().parked
    again = client.post("/fleet/placement/parked/llama-8b/retry/", HTTP_HX_REQUEST="true").content.decode()
    assert "is not parked" in again


def test_console_retry_is_post_and_staff_only(client, admin_user, member):
    fail("crash", times=5)
    client.force_login(member)
    assert client.post("/fleet/placement/parked/llama-8b/retry/").status_code == 403
    assert RecoveryState.objects.get().parked
    client.force_login(admin_user)
    assert client.get("/fleet/placement/parked/llama-8b/retry/").status_code == 405
    response = client.post("/fleet/placement/parked/llama-8b/retry/")
    assert response.status_code == 302 and response["Location"] == "/fleet/placement/"
    assert not RecoveryState.objects.get().parked


def test_the_operator_sets_the_policys_rules_and_every_snapshot_and_the_ladder_use_them(settings):
    from scheduler.policy.inputs import Settings
    from scheduler.snapshot import current_snapshot, policy_settings

    assert policy_settings() == Settings()  # the defaults are the spec's: 5 min, 3 victims, parked at 5
    settings.SCHEDULER_MIN_LIFETIME_SECONDS, settings.SCHEDULER_MAX_VICTIMS = 60, 4
    settings.SCHEDULER_PARK_AFTER, settings.SCHEDULER_PREEMPT_HOLD_SECONDS = 2, 120
    settings.SCHEDULER_STARVED_AFTER_SECONDS = 10
    tuned = policy_settings()
    assert (tuned.min_lifetime_s, tuned.max_victims, tuned.park_after, tuned.crash_retries) == (60, 4, 2, 1)
    assert (tuned.preempt_hold_s, tuned.starved_after_s) == (120, 10)
    assert current_snapshot().settings == tuned
    assert not fail("crash").parked
    assert fail("crash").parked  # the second crash in a row parks it now
