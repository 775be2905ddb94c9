"""Registering nodes: idempotent, unknown figures kept absent, bad reports refused with every problem."""

from datetime import timedelta

import pytest
from django.contrib.auth import authenticate
from django.core.management import call_command
from django.utils import timezone

from scheduler.errors import InvalidNodeReport
from scheduler.models import Node, NodeEngine
from scheduler.services import EngineReport, NodeReport, register_node

pytestmark = pytest.mark.django_db

REPORT = NodeReport(name="gpu-01", address="127.0.0.1", cpu_count=32, memory_total_bytes=2**36,
                    engines=(EngineReport(kind="llamacpp", version="b1"),))


def test_the_same_report_twice_changes_nothing_but_the_heartbeat():
    first = register_node(REPORT)
    second = register_node(REPORT)
    assert first.pk == second.pk
    assert Node.objects.count() == 1 and NodeEngine.objects.count() == 1
    assert second.memory_available_bytes is None  # not reported: absent, never 0


def test_engine_no_longer_reported_is_removed():
    register_node(REPORT)
    register_node(NodeReport(name="gpu-01", address="127.0.0.1"))
    assert not NodeEngine.objects.exists()


def test_lost_node_that_reports_again_is_ready_but_a_cordoned_one_stays_cordoned():
    node = register_node(REPORT)
    Node.objects.filter(pk=node.pk).update(state=Node.State.LOST,
                                           last_heartbeat_at=timezone.now() - timedelta(hours=1))
    assert register_node(REPORT).state == Node.State.READY
    Node.objects.filter(pk=node.pk).update(state=Node.State.CORDONED)
    assert register_node(REPORT).state == Node.State.CORDONED


def test_invalid_report_lists_every_problem():
    with pytest.raises(InvalidNodeReport) as failure:
        register_node(NodeReport(name="", address="", cpu_count=-1))
    assert failure.value.code == "invalid_node_report"
    assert set(failure.value.details) == {"name", "address", "cpu_count"}
    assert not Node.objects.exists()


@pytest.mark.parametrize("engine, problem", [
    (EngineReport(kind="tgi", version="1"), "unknown engine kind 'tgi'"),
    (EngineReport(kind="llamacpp", version="1", state="melted"), "llamacpp: unknown state 'melted'"),
    (EngineReport(kind="llamacpp", version="1" * 129), "llamacpp: version is longer than 128 characters"),
    (EngineReport(kind="llamacpp", version=""), "llamacpp: a version is needed"),
])
def test_an_engine_the_node_cannot_have_is_refused_before_anything_is_written(engine, problem):
    with pytest.raises(InvalidNodeReport) as failure:
        register_node(NodeReport(name="n", address="127.0.0.1", engines=(engine,)))
    assert problem in failure.value.details["engines"]
    assert not Node.objects.exists()


def test_bootstrap_creates_one_administrator_and_shows_the_password_once(capsys, llama_server_binary):
    call_command("bootstrap")
    first = capsys.readouterr().out
    password = first.split("password:")[1].split()[0]
    assert authenticate(username="admin", password=password) is not None
    node = Node.objects.get()
    assert node.cpu_count and node.memory_total_bytes  # this machine's own figures
    assert node.engines.get().kind == "llamacpp"

    call_command("bootstrap")
    second = capsys.readouterr().out
    assert password not in second and "An administrator exists (admin)" in second
    assert Node.objects.count() == 1


def test_admin_password_is_stored_with_argon2(capsys, argon2_hashing):
    call_command("bootstrap")
    from django.contrib.auth import get_user_model

    assert get_user_model().objects.get(username="admin").password.startswith("argon2")
