"""A replica's ``started_at`` and ``ready_at`` are its load's own length apart, as the node timed it
from its engine's launch to its readiness: the round trips of the node's reports are no part of the
engine's load (they were, when each stamp was the report's arrival). A real llama-server, started by
the agent's own code in this process (``tests/assets/node_inline.py``)."""

from __future__ import annotations

import shutil
import time
from datetime import timedelta
from pathlib import Path

import pytest

from scheduler.models import Node
from serving.control.node_work import _load_stamps
from serving.deployments import service
from serving.models import DeploymentState as S
from serving.node import runtime as node_runtime
from serving.runtimes.process import ProcessRuntime
from tenancy.audit import Actor
from tests.assets.agent import NODE
from tests.assets.node_inline import InlineClient, run_next

LATE_SECONDS = 1.0  # how long the control plane takes to hear of the launch, in the test below


@pytest.mark.django_db(transaction=True)
def test_a_load_is_timed_by_the_node_not_by_when_its_reports_arrived(tmp_path, monkeypatch, model_root, node,
                                                                      tiny_model):
    runtime = ProcessRuntime(tmp_path / "engines")
    monkeypatch.setattr(node_runtime, "_runtimes", {"process": runtime})
    client = InlineClient(node)
    real_post = client.post

    def post(path, body=None, **options):
        if (body or {}).get("event") == "launched":
            time.sleep(LATE_SECONDS)  # latency injected, not a wait: a control plane slow to hear of it
        return real_post(path, body, **options)

    client.post = post
    path = Path(shutil.copy(tiny_model, model_root / "timed.gguf"))
    deployment = service.deploy(Actor(system="tests"), service.DeployRequest(
        name="timed", model_path=str(path), node=Node.objects.get(name=NODE), config={"context": 256}))
    try:
        run_next(client, "start")
        replica = deployment.replica_set.get()
        assert replica.state == S.READY
        loading = replica.events.get(to_state=S.LOADING).at  # when the control plane heard of the launch
        # The engine was launched before its report was heard of, by about the report's delay...
        assert replica.started_at <= loading - timedelta(seconds=LATE_SECONDS * 0.9)
        # ...and the load the node timed includes the wait for that answer, as the engine loaded meanwhile.
        assert replica.ready_at - replica.started_at >= timedelta(seconds=LATE_SECONDS)
    finally:
        for handle in runtime.managed():
            runtime.stop(handle, grace_seconds=5)


@pytest.mark.parametrize("said", [None, -0.5, 10**9, True, "0.3", float("nan")])
def test_a_load_length_no_load_takes_is_not_believed(said):
    assert _load_stamps(said) == {}


def test_a_believable_load_length_sets_both_stamps_that_far_apart():
    stamps = _load_stamps(0.25)
    assert stamps["ready_at"] - stamps["started_at"] == timedelta(seconds=0.25)
