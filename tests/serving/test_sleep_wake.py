"""Sleep and wake: vLLM's HTTP contract (served on loopback: no GPU here), the memory freed and
claimed back, and llama.cpp's plain refusal."""

from urllib.parse import urlparse

import pytest

from scheduler.models import MemoryReservation
from scheduler.services import NodeReport, register_node
from serving import agent
from serving.deployments import service
from serving.deployments.service import holder_of
from serving.errors import SleepNotSupported
from serving.keys import replica_key
from serving.models import Deployment, Replica
from tenancy.audit import Actor
from tests.assets.vllm_contract import ContractServer

pytestmark = pytest.mark.django_db
GIB = 2**30
ADMIN = Actor(system="tests")


@pytest.fixture
def contract():
    server = ContractServer()
    yield server
    server.close()


@pytest.fixture
def replica(contract):
    node = register_node(NodeReport(name="gpu-box", address="127.0.0.1", cpu_count=8,
                                    memory_total_bytes=64 * GIB, memory_available_bytes=40 * GIB))
    deployment = Deployment.objects.create(name="big", engine="vllm", model_path="/models/big", node=node,
                                           memory_reserved_bytes=4 * GIB, state="ready")
    made = Replica.objects.create(deployment=deployment, node=node, port=urlparse(contract.base_url).port,
                                  state="ready", memory_reserved_bytes=4 * GIB)
    MemoryReservation.objects.create(node=node, holder=holder_of(made), bytes=4 * GIB)
    return made


def test_sleep_frees_the_memory_and_wake_claims_it_back(contract, replica):
    agent.sleep_replica(str(replica.public_id))
    replica.refresh_from_db()
    assert replica.state == "sleeping" and replica.deployment.__class__.objects.get().state == "sleeping"
    assert not MemoryReservation.objects.exists()
    agent.wake_replica(str(replica.public_id))
    replica.refresh_from_db()
    assert replica.state == "ready"
    assert MemoryReservation.objects.get().bytes == 4 * GIB
    assert [(c["method"], c["path"]) for c in contract.calls] == [("POST", "/sleep"), ("POST", "/wake_up")]
    assert contract.calls[0]["query"] == {"level": ["1"]}
    assert {c["authorization"] for c in contract.calls} == {f"Bearer {replica_key(replica.public_id)}"}


def test_wake_is_refused_while_the_memory_is_taken(contract, replica):
    agent.sleep_replica(str(replica.public_id))
    node = replica.node
    node.memory_available_bytes = 2 * GIB  # someone else took the memory meanwhile
    node.save(update_fields=["memory_available_bytes"])
    agent.wake_replica(str(replica.public_id))
    replica.refresh_from_db()
    assert replica.state == "sleeping"
    assert "wake refused" in replica.events.order_by("-at", "-id").first().message
    assert ("POST", "/wake_up") not in [(c["method"], c["path"]) for c in contract.calls]
    assert not MemoryReservation.objects.exists()


def test_llama_cpp_cannot_sleep(db):
    node = register_node(NodeReport(name="cpu", address="127.0.0.1"))
    deployment = Deployment.objects.create(name="small", engine="llamacpp", model_path="/m.gguf", node=node,
                                           state="ready")
    with pytest.raises(SleepNotSupported, match="cannot sleep: stop small"):
        service.sleep(ADMIN, deployment)
