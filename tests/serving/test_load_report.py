"""What the gateway sees of load, as the placement loop and the stops read it: each process's report
replaces its own, reports are summed, a report gone stale counts for nothing, a withdrawn one is
gone; a stopping replica's stop job is held back until what is in flight on it has drained."""

import dataclasses
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from scheduler.services import NodeReport, register_node
from serving import load
from serving.deployments import stopping
from serving.models import Deployment, NodeJob, Replica
from serving.runtimes.base import Handle
from tests.assets.llama_server import free_port
from tests.assets.node_inline import InlineClient, claim

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True, params=["redis", "cache"])
def backend(request, settings):
    """Both stores: Redis (a hash, one field per process) and Django's cache (the embedded mode)."""
    if request.param == "cache":
        settings.REDIS_URL = ""
    load.withdraw("a")
    load.withdraw("b")
    cache.delete(load.KEY)
    yield request.param
    load.withdraw("a")
    load.withdraw("b")


def test_reports_are_summed_per_replica_and_per_model():
    load.publish("a", {"r1": 2, "r2": 0}, {"lazy": 1}, now=1000.0)
    load.publish("b", {"r1": 1, "r3": 4}, {"lazy": 2, "other": 0}, now=1001.0)
    seen = load.current(now=1005.0)
    assert seen.in_flight == {"r1": 3, "r3": 4}  # zero counts are not reported
    assert seen.waiting == {"lazy": 3}
    assert seen.running(["r1", "r2", "r3"]) == 7


def test_a_new_report_replaces_the_old_one_of_the_same_process():
    load.publish("a", {"r1": 5}, {}, now=1000.0)
    load.publish("a", {}, {}, now=1002.0)
    assert load.current(now=1003.0).in_flight == {}


def test_a_stale_report_counts_for_nothing_and_a_withdrawn_one_is_gone():
    load.publish("a", {"r1": 1}, {}, now=1000.0)
    load.publish("b", {"r2": 1}, {}, now=1000.0 + load.STALE_S)
    assert load.current(now=1000.0 + load.STALE_S + 1).in_flight == {"r2": 1}  # a's process went away
    load.withdraw("b")
    assert load.current(now=1000.0 + load.STALE_S + 1).in_flight == {}


def test_the_oldest_wait_per_model_is_kept():
    load.publish("a", {}, {"lazy": 2}, now=1000.0, waiting_since={"lazy": 990.0})
    load.publish("b", {}, {"lazy": 1, "gone": 0}, now=1000.0, waiting_since={"lazy": 995.0, "gone": 900.0})
    assert load.current(now=1001.0).waiting_since == {"lazy": 990.0}  # nothing waits for "gone" any more


def stopping_replica(node, name: str) -> Replica:
    """A replica whose engine runs on ``node``, just stopped: ``stopping``, its stop job queued."""
    deployment = Deployment.objects.create(name=name, engine="llamacpp", model_path=f"/models/{name}.gguf", node=node,
                                           state="ready")
    replica = Replica.objects.create(deployment=deployment, node=node, port=free_port(), state="ready")
    replica.handle = dataclasses.asdict(Handle(runtime="process", replica_id=str(replica.public_id), pid=None))
    replica.save(update_fields=["handle"])
    stopping.begin(replica)
    replica.refresh_from_db()
    assert replica.state == "stopping"
    return replica


def handed_out(client) -> str | None:
    """Whose stop the node's next claim hands it (the replica's public id), or None when none is claimable."""
    job = claim(client)
    assert job is None or job.kind == "stop"
    return None if job is None else job.payload["handle"]["replica_id"]


def test_a_stopping_replica_is_drained_of_what_the_gateways_have_in_flight(backend, settings):
    settings.SERVING_DRAIN_SECONDS = 60
    client = InlineClient(register_node(NodeReport(name="draining", address="127.0.0.1")))
    idle = stopping_replica(client.node, "idle")
    assert handed_out(client) == str(idle.public_id)  # nothing in flight: at once

    busy = stopping_replica(client.node, "busy")
    load.publish("a", {str(busy.public_id): 1}, {})
    assert handed_out(client) is None  # held back while a request is in flight on it
    assert NodeJob.objects.get(replica=busy).state == "queued"
    load.publish("a", {}, {})
    assert handed_out(client) == str(busy.public_id)  # the request finished: drained

    stuck = stopping_replica(client.node, "stuck")
    load.publish("a", {str(stuck.public_id): 2}, {})
    assert handed_out(client) is None
    # The drain's grace passes: the job says when it was queued, so that moves back rather than the test waiting.
    NodeJob.objects.filter(replica=stuck).update(created_at=timezone.now() - timedelta(seconds=61))
    assert handed_out(client) == str(stuck.public_id)  # still busy after the grace: stopped anyway
