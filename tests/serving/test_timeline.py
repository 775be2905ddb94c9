"""The deployment timeline: a bar per replica, a segment per state, lasting until the next change
(the last until now), and on the deployment's page."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest

from serving.views.timeline import timeline

T0 = dt.datetime(2026, 12, 2, 14, 0, 0, tzinfo=dt.timezone.utc)


def event(replica_id, seconds, to_state):
    return SimpleNamespace(replica_id=replica_id, at=T0 + dt.timedelta(seconds=seconds), to_state=to_state)


def deployment(*replicas):
    return SimpleNamespace(replica_set=SimpleNamespace(all=lambda: list(replicas)))


def replica(pk, node):
    return SimpleNamespace(pk=pk, node=SimpleNamespace(name=node), public_id=f"{pk:08d}-0000")


def test_each_state_lasts_until_the_next_and_the_last_until_now():
    events = [event(1, 0, "planned"), event(1, 10, "starting"), event(1, 30, "ready"),
              event(2, 50, "planned"), event(2, 60, "failed")]
    shown = timeline(deployment(replica(1, "node-a"), replica(2, "node-b")), events, T0 + dt.timedelta(seconds=100))
    first, second = shown["rows"]
    assert first["label"] == "node-a · 00000001" and second["label"] == "node-b · 00000002"
    assert [(s["state"], s["left"], s["width"]) for s in first["segments"]] == [
        ("planned", "0.00", "10.00"), ("starting", "10.00", "20.00"), ("ready", "30.00", "70.00")]
    assert [(s["state"], s["left"], s["width"]) for s in second["segments"]] == [
        ("planned", "50.00", "10.00"), ("failed", "60.00", "40.00")]
    assert first["segments"][-1]["title"].startswith("ready from 14:00:30 to now (1\xa0minute")


def test_a_moment_still_shows_and_nothing_spills_past_the_end():
    events = [event(1, 0, "planned"), event(1, 0, "starting"), event(1, 1000, "ready")]
    segments = timeline(deployment(replica(1, "n")), events, T0 + dt.timedelta(seconds=1000))["rows"][0]["segments"]
    assert segments[0]["width"] == "0.40"  # planned for no time at all: still a sliver
    assert segments[-1]["left"] == "100.00" and segments[-1]["width"] == "0.00"


def test_no_event_yet_means_no_timeline():
    assert timeline(deployment(), [SimpleNamespace(replica_id=None, at=T0, to_state="planned")], T0) is None


@pytest.mark.django_db
def test_the_deployment_page_draws_it(client, admin_user):
    from scheduler.services import NodeReport, register_node
    from serving.models import Deployment, DeploymentEvent, Replica

    node = register_node(NodeReport(name="timeline-node", address="127.0.0.1", cpu_count=2))
    deployment = Deployment.objects.create(name="drawn", model_path="/m.gguf", node=node, state="ready")
    one = Replica.objects.create(deployment=deployment, node=node, state="ready", port=18080)
    for state in ("planned", "starting", "ready"):
        DeploymentEvent.objects.create(deployment=deployment, replica=one, to_state=state)
    client.force_login(admin_user)
    html = client.get(f"/models/deployments/{deployment.public_id}/").content.decode()
    assert '<div class="timeline"' in html and "timeline-node · " in html
    assert html.count('class="segment state-') == 3 and 'class="segment state-ready"' in html
