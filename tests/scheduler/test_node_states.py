"""Cordon, uncordon, drain and lost: services with audit events in the same transaction."""

from datetime import timedelta

import pytest
from django.utils import timezone

from scheduler import services
from scheduler.errors import InvalidNodeState
from scheduler.models import Node
from tenancy import audit
from tenancy.models import AuditEvent

pytestmark = pytest.mark.django_db


def test_cordon_uncordon_and_drain_move_the_state_and_leave_audit_events(cpu_node, admin_user):
    actor = audit.Actor(user=admin_user)
    assert services.cordon(cpu_node, actor, reason="maintenance").state == Node.State.CORDONED
    assert services.drain(cpu_node, actor).state == Node.State.DRAINING
    assert services.uncordon(cpu_node, actor).state == Node.State.READY
    events = list(AuditEvent.objects.order_by("id").values_list("action", "actor", "object_id"))
    assert [e[0] for e in events] == ["node.cordon", "node.drain", "node.uncordon"]
    assert all(e[1] == "user:ada" and e[2] == str(cpu_node.public_id) for e in events)
    assert AuditEvent.objects.order_by("id").first().details["reason"] == "maintenance"


def test_asking_twice_is_harmless_and_records_once(cpu_node):
    services.cordon(cpu_node, audit.SYSTEM)
    services.cordon(cpu_node, audit.SYSTEM)
    assert AuditEvent.objects.filter(action="node.cordon").count() == 1


def test_a_lost_node_cannot_be_drained(cpu_node):
    Node.objects.filter(pk=cpu_node.pk).update(state=Node.State.LOST)
    with pytest.raises(InvalidNodeState) as failure:
        services.drain(cpu_node, audit.SYSTEM)
    assert failure.value.code == "invalid_node_state" and failure.value.status == 409
    assert not AuditEvent.objects.exists()


def test_nodes_whose_heartbeats_stopped_become_lost(cpu_node, settings):
    settings.SCHEDULER_NODE_LOST_AFTER = 60
    fresh = services.register_node(services.NodeReport(name="fresh", address="127.0.0.1"))
    Node.objects.filter(pk=cpu_node.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=61))
    assert services.mark_lost_nodes() == ["cpu-01"]
    cpu_node.refresh_from_db()
    fresh.refresh_from_db()
    assert cpu_node.state == Node.State.LOST and fresh.state == Node.State.READY
    assert AuditEvent.objects.get().action == "node.lost"
    assert services.mark_lost_nodes() == []  # already lost: nothing more
