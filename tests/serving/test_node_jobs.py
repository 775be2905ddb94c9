"""Leased node jobs (serving.control.node_jobs) and the node API over them (/api/node/jobs/).

A job is queued once per idempotency key and handed out most urgent first; a claim waits (a long
poll) and returns as soon as a job is queued; the node holds it under a lease it extends, and every
call on the job carries that lease: an expired one returns the job to the queue, and a late
completion with it is refused (409 node_lease_stale). Attempts past the job's maximum fail it. A
node reaches only its own jobs (403 node_ownership_mismatch, audited); a revoked node nothing.

The handlers are test stand-ins registered for the test's kinds; the registry is restored after.
Time is driven by writing old values: a lease in the past is one that ran out."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from rest_framework.test import APIClient

from scheduler import enrolment
from scheduler.models import Node
from serving import events, queues
from serving.control import node_jobs
from serving.models import Deployment, NodeJob, Replica
from tenancy.audit import SYSTEM
from tenancy.models import AuditEvent

pytestmark = pytest.mark.django_db

ECHO = "test-echo"  # a kind of these tests only


class Recorder:
    """A kind's handler that writes down what it is told and answers as set."""

    def __init__(self):
        self.completed, self.failed, self.reports, self.seen_at_claim = [], [], [], []
        self.hold_back: set[str] = set()  # idempotency keys ``claimable`` refuses
        self.extra: dict | None = {}  # what ``claimed`` adds (None: cancel)

    def register(self, kind: str) -> None:
        node_jobs.register(kind, complete=self.complete, fail=self.fail, report=self.report,
                           claimable=self.claimable, claimed=self.claimed)

    def complete(self, job, result):
        self.completed.append((job.public_id, job.state, result))
        return {"recorded": True}

    def fail(self, job, error, details):
        self.failed.append((job.public_id, job.state, error, details))
        return {"noted": error}

    def report(self, job, event, data):
        self.reports.append((job.public_id, event, data))
        if event == "odd":
            raise node_jobs.UnknownReport("not a report of this kind")
        return {"go": True}

    def claimable(self, job):
        return job.idempotency_key not in self.hold_back

    def claimed(self, job):
        self.seen_at_claim.append((job.public_id, job.state, job.attempts))
        return self.extra


@pytest.fixture
def handler(monkeypatch):
    monkeypatch.setattr(node_jobs, "HANDLERS", dict(node_jobs.HANDLERS))  # restored after the test
    recorder = Recorder()
    for kind in (ECHO, NodeJob.Kind.STOP, NodeJob.Kind.START, NodeJob.Kind.PROBE):
        recorder.register(kind)
    return recorder


def make_node(name: str = "gpu-a") -> Node:
    return Node.objects.create(name=name, address="127.0.0.1")


def queue(node, key: str, kind: str = ECHO, **options) -> NodeJob:
    return node_jobs.enqueue(node, kind, key=key, **options)


def lease_ran_out(job: NodeJob) -> None:
    NodeJob.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def api_for(node: Node) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {enrolment.issue_credential(SYSTEM, node)}")
    return client


def post(client: APIClient, path: str, body: dict):
    return client.post(f"/api/node/jobs/{path}", body, format="json")


# -- the queue ---------------------------------------------------------------------------------------

def test_queueing_twice_with_one_key_gives_the_first_job_back_as_it_is(handler):
    node = make_node()
    first = queue(node, "start:r1", payload={"n": 1})
    again = queue(node, "start:r1", payload={"n": 2}, priority=0)
    assert again.pk == first.pk
    assert again.payload == {"n": 1} and again.priority == NodeJob.BULK
    assert NodeJob.objects.filter(idempotency_key="start:r1").count() == 1


def test_a_kind_nobody_handles_cannot_be_queued(handler):
    with pytest.raises(LookupError):
        queue(make_node(), "k", kind="no-such-kind")


def test_a_maintenance_job_is_claimed_before_an_older_bulk_job_then_oldest_first(handler):
    node = make_node()
    probe = queue(node, "probe", kind=NodeJob.Kind.PROBE)
    start = queue(node, "start", kind=NodeJob.Kind.START)
    stop = queue(node, "stop", kind=NodeJob.Kind.STOP)
    older_probe = probe
    newer_probe = queue(node, "probe-2", kind=NodeJob.Kind.PROBE)
    assert (probe.priority, start.priority, stop.priority) == (NodeJob.BULK, NodeJob.LIFECYCLE, NodeJob.MAINTENANCE)
    order = [node_jobs.claim(node, wait_seconds=0)[0].pk for _ in range(4)]
    assert order == [stop.pk, start.pk, older_probe.pk, newer_probe.pk]
    assert node_jobs.claim(node, wait_seconds=0) is None


def test_a_job_is_not_handed_out_before_it_is_available(handler):
    node = make_node()
    later = queue(node, "later", available_at=timezone.now() + timedelta(hours=1))
    assert node_jobs.claim(node, wait_seconds=0) is None
    NodeJob.objects.filter(pk=later.pk).update(available_at=timezone.now() - timedelta(seconds=1))
    assert node_jobs.claim(node, wait_seconds=0)[0].pk == later.pk


def test_claimable_holds_a_job_back_and_the_next_one_is_handed_out(handler):
    node = make_node()
    draining = queue(node, "stop-draining", kind=NodeJob.Kind.STOP)
    other = queue(node, "stop-other", kind=NodeJob.Kind.STOP)
    handler.hold_back = {"stop-draining"}
    assert node_jobs.claim(node, wait_seconds=0)[0].pk == other.pk
    assert node_jobs.claim(node, wait_seconds=0) is None
    draining.refresh_from_db()
    assert draining.state == NodeJob.State.QUEUED and draining.attempts == 0
    handler.hold_back = set()
    assert node_jobs.claim(node, wait_seconds=0)[0].pk == draining.pk


def test_claimed_adds_to_what_the_node_receives_and_the_table_does_not_keep_it(handler):
    node = make_node()
    job = queue(node, "start-key", payload={"replica": "r1"})
    handler.extra = {"api_key": "bre_engine_secret"}
    claimed, lease = node_jobs.claim(node, wait_seconds=0)
    assert claimed.payload == {"replica": "r1", "api_key": "bre_engine_secret"}
    assert lease.startswith("bnl_")
    assert handler.seen_at_claim == [(job.public_id, NodeJob.State.LEASED, 1)]
    job.refresh_from_db()
    assert job.payload == {"replica": "r1"}
    assert job.state == NodeJob.State.LEASED and job.attempts == 1
    assert lease not in job.lease_digest and len(job.lease_digest) == 64  # only its SHA-256


def test_claimed_answering_none_cancels_the_job_and_the_next_one_is_handed_out(handler):
    node = make_node()
    moot = queue(node, "moot")
    handler.extra = None
    assert node_jobs.claim(node, wait_seconds=0) is None
    moot.refresh_from_db()
    assert moot.state == NodeJob.State.CANCELLED and moot.finished_at is not None


def test_cancelling_a_queued_job_ends_it_and_a_leased_one_hears_it_at_its_next_extension(handler):
    node = make_node()
    queued, leased = queue(node, "a"), queue(node, "b", priority=0)
    held, lease = node_jobs.claim(node, wait_seconds=0)
    assert held.pk == leased.pk
    assert node_jobs.request_cancel(queued).state == NodeJob.State.CANCELLED
    assert node_jobs.request_cancel(leased).state == NodeJob.State.LEASED
    assert node_jobs.extend(node, leased.public_id, lease).cancel_requested is True


def test_cancel_pending_cancels_a_replicas_queued_jobs_of_those_kinds_only(handler):
    node = make_node()
    deployment = Deployment.objects.create(name="m", model_path="/m.gguf", node=node)
    replica = Replica.objects.create(deployment=deployment, node=node, port=20001)
    start = queue(node, "start", kind=NodeJob.Kind.START, replica=replica)
    probe = queue(node, "probe", kind=NodeJob.Kind.PROBE, replica=replica)
    assert node_jobs.cancel_pending(replica, [NodeJob.Kind.START]) == 1
    start.refresh_from_db(), probe.refresh_from_db()
    assert (start.state, probe.state) == (NodeJob.State.CANCELLED, NodeJob.State.QUEUED)


# -- leases --------------------------------------------------------------------------------------

def test_extending_the_lease_moves_its_expiry_forward(handler):
    node = make_node()
    queue(node, "k")
    job, lease = node_jobs.claim(node, wait_seconds=0)
    NodeJob.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now() + timedelta(seconds=2))
    extended = node_jobs.extend(node, job.public_id, lease)
    assert extended.lease_expires_at >= timezone.now() + timedelta(seconds=settings.SERVING_NODE_LEASE_SECONDS - 1)
    assert extended.cancel_requested is False


def test_an_expired_lease_returns_the_job_and_the_late_completion_is_refused(handler):
    node = make_node()
    client = api_for(node)
    job = queue(node, "k")
    first = post(client, "claim/", {"wait": 0}).json()["job"]
    assert first["id"] == str(job.public_id) and first["attempt"] == 1
    lease_ran_out(job)
    # Before the sweep: the lease ran out, so it is not the job's any more.
    stale = post(client, f"{job.public_id}/lease/", {"lease": first["lease"]})
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "node_lease_stale"
    assert node_jobs.expire_leases() == 1
    job.refresh_from_db()
    assert job.state == NodeJob.State.QUEUED and job.lease_digest == ""
    second = post(client, "claim/", {"wait": 0}).json()["job"]
    assert second["id"] == first["id"] and second["attempt"] == 2 and second["lease"] != first["lease"]
    late = post(client, f"{job.public_id}/complete/", {"lease": first["lease"], "result": {"late": True}})
    assert late.status_code == 409 and late.json()["error"]["code"] == "node_lease_stale"
    job.refresh_from_db()
    assert job.state == NodeJob.State.LEASED and job.result == {} and handler.completed == []
    done = post(client, f"{job.public_id}/complete/", {"lease": second["lease"], "result": {"ok": 1}})
    assert done.status_code == 200 and done.json() == {"recorded": True}
    assert handler.completed == [(job.public_id, NodeJob.State.DONE, {"ok": 1})]
    again = post(client, f"{job.public_id}/complete/", {"lease": second["lease"]})
    assert again.status_code == 409, "a finished job takes no second completion"


def test_a_claim_returns_a_lease_that_ran_out_without_waiting_for_the_sweep(handler):
    node = make_node()
    job = queue(node, "k")
    _, first = node_jobs.claim(node, wait_seconds=0)
    lease_ran_out(job)
    again, second = node_jobs.claim(node, wait_seconds=0)  # no beat ran: the claim itself returned it
    assert again.pk == job.pk and again.attempts == 2 and second != first


def test_a_claim_of_an_agent_its_node_restarted_since_takes_nothing(handler):
    node = make_node()
    job = queue(node, "k")
    node_jobs.note_agent(node, "the-new-one")
    assert node_jobs.claim(node, wait_seconds=0, agent="the-dead-one") is None  # its poll would be lost
    job.refresh_from_db()
    assert job.state == NodeJob.State.QUEUED
    claimed, _ = node_jobs.claim(node, wait_seconds=0, agent="the-new-one")
    assert claimed.pk == job.pk


def test_a_lease_extended_in_time_is_not_expired(handler):
    node = make_node()
    queue(node, "k")
    job, lease = node_jobs.claim(node, wait_seconds=0)
    assert node_jobs.expire_leases() == 0
    job.refresh_from_db()
    assert job.state == NodeJob.State.LEASED


def test_expiries_past_the_maximum_attempts_fail_the_job_and_tell_its_handler(handler):
    node = make_node()
    job = queue(node, "k", max_attempts=2)
    for attempt in (1, 2):
        claimed, _ = node_jobs.claim(node, wait_seconds=0)
        assert (claimed.pk, claimed.attempts) == (job.pk, attempt)
        lease_ran_out(job)
        assert node_jobs.expire_leases() == 1
    job.refresh_from_db()
    assert job.state == NodeJob.State.FAILED and "lease expired" in job.error and job.finished_at is not None
    assert node_jobs.claim(node, wait_seconds=0) is None
    [(public_id, state, error, details)] = handler.failed
    assert (public_id, state) == (job.public_id, NodeJob.State.FAILED)
    assert "lease expired" in error and details == {"reason": "lease_expired", "attempts": 2}


def test_a_failure_with_retry_queues_the_job_again_until_its_attempts_are_spent(handler):
    node = make_node()
    job = queue(node, "k", max_attempts=2)
    _, lease = node_jobs.claim(node, wait_seconds=0)
    assert node_jobs.fail(node, job.public_id, lease, "disk busy", {"try": 1}, retry=True) == {"retried": True}
    assert handler.failed == []
    job.refresh_from_db()
    assert job.state == NodeJob.State.QUEUED and job.error == "disk busy"
    _, lease = node_jobs.claim(node, wait_seconds=0)
    answer = node_jobs.fail(node, job.public_id, lease, "disk busy again", {"try": 2}, retry=True)
    assert answer == {"noted": "disk busy again"}
    job.refresh_from_db()
    assert job.state == NodeJob.State.FAILED and job.attempts == 2
    assert handler.failed == [(job.public_id, NodeJob.State.FAILED, "disk busy again", {"try": 2})]


# -- the node API ----------------------------------------------------------------------------------

def test_the_node_claims_reports_and_completes_through_the_api(handler):
    node = make_node()
    deployment = Deployment.objects.create(name="m", model_path="/m.gguf", node=node)
    replica = Replica.objects.create(deployment=deployment, node=node, port=20001)
    client = api_for(node)
    job = queue(node, "start-r", kind=NodeJob.Kind.START, replica=replica, payload={"spec": "x"})
    handler.extra = {"api_key": "bre_delivered"}
    claimed = post(client, "claim/", {"wait": 0})
    assert claimed.status_code == 200
    body = claimed.json()["job"]
    assert body["id"] == str(job.public_id) and body["kind"] == "start" and body["replica"] == str(replica.public_id)
    assert body["payload"] == {"spec": "x", "api_key": "bre_delivered"} and body["attempt"] == 1
    lease = body["lease"]
    extended = post(client, f"{job.public_id}/lease/", {"lease": lease})
    assert extended.status_code == 200 and extended.json()["cancel_requested"] is False
    reported = post(client, f"{job.public_id}/report/", {"lease": lease, "event": "launched", "data": {"pid": 7}})
    assert reported.status_code == 200 and reported.json() == {"go": True}
    assert handler.reports == [(job.public_id, "launched", {"pid": 7})]
    odd = post(client, f"{job.public_id}/report/", {"lease": lease, "event": "odd"})
    assert odd.status_code == 400 and odd.json()["error"]["code"] == "unknown_node_report"
    wrong = post(client, f"{job.public_id}/complete/", {"lease": "bnl_not-this-one"})
    assert wrong.status_code == 409 and wrong.json()["error"]["code"] == "node_lease_stale"
    done = post(client, f"{job.public_id}/complete/", {"lease": lease, "result": {"peak": 5}})
    assert done.status_code == 200 and done.json() == {"recorded": True}
    job.refresh_from_db()
    assert job.state == NodeJob.State.DONE and job.result == {"peak": 5} and "bre_delivered" not in str(job.payload)


def test_the_node_fails_a_job_through_the_api(handler):
    node = make_node()
    client = api_for(node)
    job = queue(node, "k")
    lease = post(client, "claim/", {"wait": 0}).json()["job"]["lease"]
    failed = post(client, f"{job.public_id}/fail/", {"lease": lease, "error": "exit 1", "details": {"tail": "oom"}})
    assert failed.status_code == 200 and failed.json() == {"noted": "exit 1"}
    job.refresh_from_db()
    assert job.state == NodeJob.State.FAILED and job.error == "exit 1"


def test_an_unknown_job_is_404(handler):
    client = api_for(make_node())
    answer = post(client, "00000000-0000-4000-8000-000000000000/complete/", {"lease": "bnl_x"})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "node_job_not_found"


def test_claim_answers_204_once_its_wait_has_passed_with_nothing_queued(handler):
    client = api_for(make_node())
    began = time.monotonic()
    answer = post(client, "claim/", {"wait": 0.3})
    assert answer.status_code == 204
    assert time.monotonic() - began >= 0.3


def test_a_second_nodes_credential_never_receives_nor_touches_the_first_nodes_jobs(handler):
    first, second = make_node("gpu-a"), make_node("gpu-b")
    mine, theirs = api_for(first), api_for(second)
    job = queue(first, "k")
    assert post(theirs, "claim/", {"wait": 0}).status_code == 204
    lease = post(mine, "claim/", {"wait": 0}).json()["job"]["lease"]
    for path, body in (("lease/", {"lease": lease}), ("report/", {"lease": lease, "event": "say"}),
                       ("complete/", {"lease": lease}), ("fail/", {"lease": lease, "error": "forged"})):
        refused = post(theirs, f"{job.public_id}/{path}", body)
        assert refused.status_code == 403, path
        assert refused.json()["error"]["code"] == "node_ownership_mismatch", path
    events = AuditEvent.objects.filter(action="node.ownership_mismatch", object_id=str(job.public_id))
    assert events.count() == 4
    assert {e.actor for e in events} == {"node:gpu-b"}
    assert {e.details["what"] for e in events} == {"extend the lease of job", "report on job", "complete job",
                                                   "fail job"}
    job.refresh_from_db()
    assert job.state == NodeJob.State.LEASED and handler.completed == handler.failed == handler.reports == []
    assert post(mine, f"{job.public_id}/complete/", {"lease": lease}).status_code == 200


def test_a_revoked_nodes_credential_is_refused_at_once(handler):
    node = make_node()
    client = api_for(node)
    queue(node, "k")
    enrolment.revoke(SYSTEM, node)
    answer = post(client, "claim/", {"wait": 0})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "node_revoked"
    assert NodeJob.objects.get().state == NodeJob.State.QUEUED


def test_other_credentials_are_refused_by_the_node_api(handler, personas):
    session = APIClient()
    session.force_login(personas.olivia)
    assert post(session, "claim/", {"wait": 0}).status_code == 401
    assert post(APIClient(), "claim/", {"wait": 0}).status_code == 401


def test_the_sweep_is_a_named_periodic_task():
    from serving import tasks

    [entry] = [e for e in settings.CELERY_BEAT_SCHEDULE.values() if e["task"] == queues.EXPIRE_NODE_LEASES]
    assert entry["schedule"] <= 10
    assert tasks.expire_node_leases.name == queues.EXPIRE_NODE_LEASES
    assert tasks.expire_node_leases() == 0


def test_staff_see_a_nodes_recent_jobs_one_line_each(handler, admin_client):
    node = make_node()
    queue(node, "k", kind=NodeJob.Kind.PROBE)
    queue(node, "s", kind=NodeJob.Kind.STOP)
    node_jobs.claim(node, wait_seconds=0)
    page = admin_client.get(f"/models/nodes/{node.public_id}/jobs/", HTTP_HX_REQUEST="true")
    assert page.status_code == 200
    text = page.content.decode()
    assert text.count("<tr><td") == 2
    assert "Stop" in text and "Leased" in text and "Probe" in text and "Queued" in text and "1 of 3" in text


# -- across threads and connections -------------------------------------------------------------------

def claim_in_thread(node, wait_seconds: float, outcome: dict) -> threading.Thread:
    def run():
        try:
            outcome["claimed"] = node_jobs.claim(node, wait_seconds=wait_seconds)
            outcome["returned_at"] = time.monotonic()
        except Exception as error:  # noqa: BLE001 - said by the test
            outcome["error"] = error
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.fixture
def waiting(monkeypatch):
    """Set once a claim has looked, found nothing, and waits."""
    event, real = threading.Event(), node_jobs._announcements

    @contextlib.contextmanager
    def announcements(node):
        with real(node) as wait:
            def signalled(left):
                event.set()
                wait(left)

            yield signalled

    monkeypatch.setattr(node_jobs, "_announcements", announcements)
    return event


def claim_while(waiting, node, queue_job):
    """Start a claim, queue a job (by `queue_job`) once it waits; answer how long after that it returned."""
    outcome = {}
    thread = claim_in_thread(node, 10, outcome)
    assert waiting.wait(10), "the claim did not wait"
    job = queue_job()
    queued_at = time.monotonic()
    thread.join(15)
    assert "error" not in outcome, outcome
    assert outcome["claimed"][0].pk == job.pk
    return outcome["returned_at"] - queued_at


@pytest.mark.django_db(transaction=True)
def test_a_waiting_claim_returns_at_once_when_this_process_queues_a_job(handler, waiting):
    node = make_node()

    def queue_here():
        with transaction.atomic():  # another transaction than the claim's, on another connection
            return queue(node, "k")

    assert claim_while(waiting, node, queue_here) < 0.2


@pytest.mark.django_db(transaction=True)
def test_a_waiting_claim_hears_of_a_job_another_process_queued_at_once(handler, waiting):
    node = make_node()

    def queue_elsewhere():
        # Written as another process would: its announcement goes over Redis (without Redis: the next look).
        job = NodeJob.objects.create(node=node, kind=ECHO, idempotency_key="elsewhere", priority=NodeJob.BULK)
        events.publish(queues.node_jobs_channel(node.pk), "1")
        return job

    assert claim_while(waiting, node, queue_elsewhere) < 0.2


@pytest.mark.django_db(transaction=True)
def test_a_job_whose_announcement_was_lost_is_found_at_the_next_look(handler, waiting):
    node = make_node()

    def queue_unannounced():
        return NodeJob.objects.create(node=node, kind=ECHO, idempotency_key="unannounced", priority=NodeJob.BULK)

    look = node_jobs.REDIS_LOOK_SECONDS if settings.REDIS_URL else node_jobs.POLL_SECONDS
    assert claim_while(waiting, node, queue_unannounced) < look + 0.3


@pytest.mark.django_db(transaction=True)
def test_concurrent_claimers_never_get_the_same_job(handler):
    """Four threads, each on its own connection, claim the same node's jobs at once, round after round.
    On PostgreSQL they pass each other's locked rows by (SKIP LOCKED); on SQLite their transactions take
    turns (IMMEDIATE); on both the conditional seal decides."""
    node = make_node()
    for round_ in range(3):
        jobs = {queue(node, f"r{round_}-{n}").pk for n in range(30)}
        barrier, claimed, errors = threading.Barrier(4), [], []

        def claimer():
            try:
                barrier.wait(10)
                while (got := node_jobs.claim(node, wait_seconds=0)) is not None:
                    claimed.append(got[0].pk)
            except Exception as error:  # noqa: BLE001 - said by the test
                errors.append(error)
            finally:
                connection.close()

        threads = [threading.Thread(target=claimer) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        assert [pk for pk, n in Counter(claimed).items() if n > 1] == [], "a job was handed out twice"
        assert set(claimed) == jobs
        assert set(NodeJob.objects.filter(pk__in=jobs).values_list("attempts", flat=True)) == {1}
