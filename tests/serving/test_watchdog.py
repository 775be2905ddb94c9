"""The memory watchdog: levels from MemAvailable against the margin, and the deployment it stops."""

import pytest
from django.core.cache import cache

from scheduler.services import NodeReport, register_node
from serving.control import watchdog
from serving.deployments import service
from serving.models import Deployment
from tenancy.models import AuditEvent

GIB = 2**30


@pytest.mark.parametrize("available, level", [(20 * GIB, "ok"), (11 * GIB, "warning"), (7 * GIB, "critical"),
                                              (None, None)])
def test_levels_against_an_eight_gib_margin(available, level):
    assert watchdog.assess(available, 8 * GIB) == level


def test_victim_is_the_lowest_priority_then_the_largest_reservation():
    candidates = [watchdog.Candidate("a", 50, 4 * GIB), watchdog.Candidate("b", 10, 1 * GIB),
                  watchdog.Candidate("c", 10, 6 * GIB), watchdog.Candidate("d", 90, 20 * GIB)]
    assert watchdog.choose_victim(candidates).key == "c"
    assert watchdog.choose_victim([]) is None


@pytest.fixture
def node(db):
    cache.clear()
    return register_node(NodeReport(name="tight", address="127.0.0.1", cpu_count=4, memory_total_bytes=32 * GIB,
                                    memory_available_bytes=20 * GIB))


def deployment(node, name, priority, reserved):
    made = Deployment.objects.create(name=name, model_path="/models/x.gguf", node=node, priority=priority,
                                     memory_reserved_bytes=reserved, state="ready")
    return made


def test_level_change_is_audited_once_and_critical_stops_the_right_deployment(node, monkeypatch, settings):
    settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB = 8
    settings.SERVING_AUTO_PROTECT = True
    stopped = []
    monkeypatch.setattr(service, "stop", lambda actor, d: stopped.append(d.name))
    deployment(node, "important", 90, 2 * GIB)
    deployment(node, "batch-small", 10, 1 * GIB)
    deployment(node, "batch-large", 10, 6 * GIB)
    assert watchdog.check(node) == "ok"
    node.memory_available_bytes = 5 * GIB
    assert watchdog.check(node) == "critical"
    assert watchdog.check(node) == "critical"  # a minute has not passed: no second stop
    assert stopped == ["batch-large"]
    levels = list(AuditEvent.objects.filter(action="watchdog.level").order_by("id").values_list("details", flat=True))
    assert [(d["from"], d["to"]) for d in levels] == [(None, "ok"), ("ok", "critical")]
    assert AuditEvent.objects.filter(action="watchdog.protect").count() == 1
    assert watchdog.levels([node]) == {"tight": "critical"}


def test_without_auto_protect_it_only_warns(node, monkeypatch, settings, caplog):
    settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB = 8
    settings.SERVING_AUTO_PROTECT = False
    stopped = []
    monkeypatch.setattr(service, "stop", lambda actor, d: stopped.append(d.name))
    deployment(node, "victim", 10, GIB)
    deployment(node, "important", 90, GIB)
    node.memory_available_bytes = GIB
    with caplog.at_level("WARNING", logger="serving.control.watchdog"):
        assert watchdog.check(node) == "critical"
        assert watchdog.check(node) == "critical"  # every heartbeat: still one warning a minute
    assert stopped == [] and Deployment.objects.filter(state="ready").count() == 2
    levels = list(AuditEvent.objects.filter(action="watchdog.level").values_list("details", flat=True))
    assert [(d["from"], d["to"]) for d in levels] == [(None, "critical")]  # the level change is the event
    assert not AuditEvent.objects.filter(action="watchdog.protect").exists()
    assert watchdog.levels([node]) == {"tight": "critical"}  # the console's banner
    said = [r.getMessage() for r in caplog.records if "auto-protect is off" in r.getMessage()]
    assert len(said) == 1 and "it would stop victim" in said[0]


@pytest.mark.parametrize("value, protects", [(None, False), ("true", True), ("0", False)])
def test_auto_protect_is_off_unless_berth_auto_protect_is_set(value, protects):
    """The setting as a fresh process reads it from the environment (the default a newcomer gets)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "BERTH_AUTO_PROTECT"}
    if value is not None:
        env["BERTH_AUTO_PROTECT"] = value
    env["DJANGO_SETTINGS_MODULE"] = "berth.settings"
    program = "from django.conf import settings; print(settings.SERVING_AUTO_PROTECT)"
    read = subprocess.run([sys.executable, "-c", program], check=False, env=env, capture_output=True, text=True,
                          timeout=60)
    assert read.returncode == 0, read.stderr
    assert read.stdout.strip() == str(protects)


def test_a_malformed_berth_auto_protect_is_refused_loudly():
    import os
    import subprocess
    import sys

    env = {**os.environ, "BERTH_AUTO_PROTECT": "perhaps", "DJANGO_SETTINGS_MODULE": "berth.settings"}
    read = subprocess.run([sys.executable, "-c", "from django.conf import settings; settings.SERVING_AUTO_PROTECT"],
                          check=False, env=env, capture_output=True, text=True, timeout=60)
    assert read.returncode != 0 and "BERTH_AUTO_PROTECT" in read.stderr


def test_the_banner_shows_a_node_in_trouble(client, node, admin_user):
    cache.set(f"berth:watchdog:level:{node.pk}", "critical", None)
    client.force_login(admin_user)
    assert "Memory on tight is critical." in client.get("/").content.decode()


def test_replicas_of_a_lost_node_fail_and_release_what_they_held(node):
    from scheduler.models import MemoryReservation, Node
    from serving.deployments.service import holder_of
    from serving.models import Replica
    from serving.tasks import reconcile

    made = deployment(node, "stranded", 50, GIB)
    replica = Replica.objects.create(deployment=made, node=node, port=20001, state="ready")
    MemoryReservation.objects.create(node=node, holder=holder_of(replica), bytes=GIB)
    assert reconcile() == 0
    Node.objects.filter(pk=node.pk).update(state=Node.State.LOST)
    assert reconcile() == 1
    replica.refresh_from_db()
    assert replica.state == "failed" and "is lost" in replica.events.get().message
    assert not MemoryReservation.objects.exists()
