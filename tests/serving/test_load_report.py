"""What the gateway sees of load, as the placement loop reads it: each process's report replaces
its own, reports are summed, a report gone stale counts for nothing, a withdrawn one is gone."""

import pytest
from django.core.cache import cache

from serving import load

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


def test_a_stopping_replica_is_drained_of_what_the_gateways_have_in_flight(backend):
    import threading
    import types

    from serving.node import lifecycle as agent

    replica = types.SimpleNamespace(public_id="r-draining")
    assert agent.drain(replica, grace=5)  # nothing in flight: at once
    load.publish("a", {"r-draining": 1}, {})
    finished = threading.Timer(1.0, lambda: load.publish("a", {}, {}))
    finished.start()
    try:
        assert agent.drain(replica, grace=20)  # the request finished: drained
    finally:
        finished.join()
    load.publish("a", {"r-draining": 2}, {})
    assert not agent.drain(replica, grace=0.6)  # still busy after the grace: stop anyway
