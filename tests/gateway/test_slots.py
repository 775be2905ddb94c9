"""Workload priority at the engines' door (gateway.slots): with every slot busy, a freed slot goes to
the highest priority waiting, the earliest of those; a full queue sheds the lowest priority first;
a waiter that waits too long, or leaves, costs no slot. And through a real gateway and llama-server
with one slot: a burst from a batch client delays a critical client's request by one in-flight
request, not by the burst."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from gateway.errors import ServerBusy
from gateway.slots import SlotGate
from tests.assets.waiting import wait_until


async def holder(gate, model, capacity, priority, served, name, hold: asyncio.Event | None = None):
    async with gate.slot(model, capacity, priority):
        served.append(name)
        if hold is not None:
            await hold.wait()


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_freed_slot_goes_to_the_highest_priority_then_the_earliest():
    async def steps():
        gate, served = SlotGate(queue_size=10, wait_seconds=30), []
        first = asyncio.Event()
        tasks = [asyncio.create_task(holder(gate, "m", 1, "normal", served, "in-flight", first))]
        await settle()
        for name, priority in (("batch-1", "batch"), ("batch-2", "batch"), ("low", "low"), ("critical", "critical"),
                               ("high", "high"), ("batch-3", "batch")):
            tasks.append(asyncio.create_task(holder(gate, "m", 1, priority, served, name)))
            await settle()
        assert served == ["in-flight"] and gate.waiters("m") == 6
        first.set()
        await asyncio.gather(*tasks)
        assert served == ["in-flight", "critical", "high", "low", "batch-1", "batch-2", "batch-3"]
        assert gate.busy == {} and gate.waiting == {}  # nothing held, nothing kept
        return True

    assert asyncio.run(steps())


def test_a_full_queue_sheds_the_lowest_priority_first():
    async def steps():
        gate, served = SlotGate(queue_size=2, wait_seconds=30), []
        release = asyncio.Event()
        held = asyncio.create_task(holder(gate, "m", 1, "normal", served, "in-flight", release))
        await settle()
        early = asyncio.create_task(holder(gate, "m", 1, "batch", served, "batch-early"))
        late = asyncio.create_task(holder(gate, "m", 1, "batch", served, "batch-late"))
        await settle()
        normal = asyncio.create_task(holder(gate, "m", 1, "normal", served, "normal"))  # takes batch-late's place
        await settle()
        with pytest.raises(ServerBusy) as shed:
            await late
        assert "higher priority took its place" in shed.value.message
        assert shed.value.code == "server_busy" and (b"retry-after", b"1") in shed.value.headers
        with pytest.raises(ServerBusy):  # a batch newcomer finds no one below it to displace
            await holder(gate, "m", 1, "batch", served, "batch-refused")
        release.set()
        await asyncio.gather(held, early, normal)
        assert served == ["in-flight", "normal", "batch-early"]
        return True

    assert asyncio.run(steps())


def test_a_waiter_that_waits_too_long_or_leaves_costs_no_slot():
    async def steps():
        gate, served = SlotGate(queue_size=10, wait_seconds=0.05), []
        release = asyncio.Event()
        held = asyncio.create_task(holder(gate, "m", 1, "normal", served, "in-flight", release))
        await settle()
        with pytest.raises(ServerBusy) as timed_out:
            await holder(gate, "m", 1, "critical", served, "too-late")
        assert "no slot freed within 0.05 s" in timed_out.value.message
        gate.wait_seconds = 30
        leaver = asyncio.create_task(holder(gate, "m", 1, "critical", served, "leaver"))
        await settle()
        leaver.cancel()
        await asyncio.gather(leaver, return_exceptions=True)
        waiting = asyncio.create_task(holder(gate, "m", 1, "batch", served, "batch"))
        await settle()
        release.set()
        await asyncio.gather(held, waiting)
        assert served == ["in-flight", "batch"] and gate.busy == {}
        return True

    assert asyncio.run(steps())


def test_more_slots_admit_as_many_at_once():
    async def steps():
        gate, served = SlotGate(queue_size=10, wait_seconds=30), []
        release = asyncio.Event()
        tasks = [asyncio.create_task(holder(gate, "m", 3, "batch", served, f"r{i}", release)) for i in range(4)]
        await settle()
        assert served == ["r0", "r1", "r2"] and gate.waiters("m") == 1
        release.set()
        await asyncio.gather(*tasks)
        assert served[-1] == "r3"
        return True

    assert asyncio.run(steps())


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_batch_burst_delays_a_critical_request_by_one_in_flight_request(
        gateway, llama_server_binary, smollm2_model, artifacts_dir, deploy, make_key):
    import uuid

    from serving.keys import replica_key  # the engine accepts only the gateway
    from tests.assets.llama_server import LlamaServer

    replica_id = str(uuid.uuid4())
    # A real small model (tens of tokens a second here), so that a request is still in flight when the next come.
    server = LlamaServer(llama_server_binary, smollm2_model, artifacts_dir / "gw-one-slot.log",
                         api_key=replica_key(replica_id), threads=1, parallel=1)
    try:
        server.wait_ready()
        deploy("one-slot", types_namespace(server, replica_id), task="completion")
        batch, critical = make_key(priority="batch"), make_key(priority="critical")
        finished, lock = [], threading.Lock()

        def complete(name, key, tokens):
            answer = httpx.post(f"{gateway.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                timeout=120, json={"model": "one-slot", "prompt": "a", "max_tokens": tokens,
                                                   "ignore_eos": True})
            with lock:
                finished.append((name, answer.status_code, time.monotonic()))

        burst = [threading.Thread(target=complete, args=(f"batch-{i}", batch.key, 48)) for i in range(6)]
        for thread in burst:
            thread.start()
        wait_until(lambda: _waiting(gateway, "one-slot") >= 5, 30, what="the burst queued behind one in flight")
        urgent = threading.Thread(target=complete, args=("critical", critical.key, 8))
        urgent.start()
        for thread in [*burst, urgent]:
            thread.join(timeout=120)
        order = [name for name, status, _ in sorted(finished, key=lambda f: f[2])]
        assert all(status == 200 for _, status, _ in finished), finished
        # One batch request was in flight when it came: it is served next, ahead of the five waiting.
        assert order.index("critical") == 1, order
    finally:
        server.stop()


def types_namespace(server, replica_id):
    import types

    return types.SimpleNamespace(server=server, replica_id=replica_id)


def _waiting(gateway, model) -> int:
    """Requests waiting for a slot of ``model`` in the gateway, as its /metrics says."""
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("berth_gateway_slot_waiting{") and f'model="{model}"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_vllm_replica_that_schedules_by_priority_is_sent_each_clients_priority(gateway, tiny_engine, node,
                                                                                 make_key):
    from serving import events
    from serving.models import Deployment, Replica
    from tests.assets.recording_engine import RecordingEngine

    hop = RecordingEngine(tiny_engine.server.base_url)  # stands in for vLLM's server: it keeps what it was sent
    try:
        deployment = Deployment.objects.create(name="by-priority", task="completion", engine="vllm",
                                               config={"scheduling_policy": "priority"}, model_path="/models/x",
                                               node=node, state="ready")
        Replica.objects.create(public_id=tiny_engine.replica_id, port=hop.port, deployment=deployment, node=node,
                               state="ready")
        events.routing_changed()

        def sent(priority):
            key = make_key(priority=priority).key
            answer = httpx.post(f"{gateway.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                timeout=60, json={"model": "by-priority", "prompt": "a", "max_tokens": 1})
            assert answer.status_code == 200, answer.text
            return hop.last("/v1/completions")["body"]

        for priority, rank in (("critical", 0), ("batch", 4), ("normal", 2)):
            assert sent(priority)["priority"] == rank  # vLLM serves a lower number sooner
        # First come, first served (vLLM's default): it is sent none, which vLLM would refuse there.
        Deployment.objects.filter(pk=deployment.pk).update(config={})
        events.routing_changed()
        wait_until(lambda: "priority" not in sent("critical"), 10, what="the routing table read again")
    finally:
        hop.close()
