"""What the gateway's benchmarks and drills share: the stub engine's Berth side and its processes."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import uuid

import httpx
from django.core.management.base import CommandError

from gateway.models import UsageRecord
from scheduler.services import NodeReport, register_node
from serving.models import Deployment, Replica
from tenancy.audit import Actor
from tenancy.models import Contract
from tenancy.services import clients, contracts, tree


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, ok, timeout: float, process: subprocess.Popen, headers=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CommandError(f"{url}: the server exited with {process.returncode}")
        try:
            if ok(httpx.get(url, timeout=2, headers=headers).status_code):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise CommandError(f"{url} did not come up within {timeout:.0f}s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


REPLICAS = 4  # × 256 slots: room for the thousand concurrent streams of bench_gateway


def berth_fixture(stub_port: int) -> dict:
    """A tenant (org, team, project) with a key and limits on every level, and a ready deployment
    whose replicas are all the stub engine on ``stub_port``."""
    actor = Actor(system="bench")
    slug = "bench-" + uuid.uuid4().hex[:8]
    org = tree.create_scope(actor, "org", slug, "Bench")
    team = tree.create_scope(actor, "team", "team", "Team", org)
    project = tree.create_scope(actor, "project", "project", "Project", team)
    big = {"rpm_limit": 10**9, "tpm_limit": 2 * 10**9, "concurrency_limit": 10**6}
    for scope in (org, team, project):
        contracts.set_contract(actor, scope, daily_token_budget=10**15, weekly_token_budget=5 * 10**15,
                               monthly_token_budget=10**16, **big)
    client = clients.create_client(actor, project, "bench", all_models=True, access="inference", **big)
    _, key = clients.create_credential(actor, client)
    nodes = [register_node(NodeReport(name=f"{slug}-node-{index}", address="127.0.0.1")) for index in range(REPLICAS)]
    # The stub answers any number at once: replicas with as many slots as llama.cpp takes (all of them
    # the one stub, each on a node of its own), so the gateway's slot gate (gateway.slots) never holds
    # back even the thousand streams opened at once, and what is measured is the gateway's own cost.
    deployment = Deployment.objects.create(name="bench-model", model_path="/stub", node=nodes[0], state="ready",
                                           config={"parallel": 256})
    for node in nodes:
        Replica.objects.create(deployment=deployment, node=node, port=stub_port, state="ready")
    return {"key": key, "org": org, "team": team, "project": project, "client": client, "nodes": nodes,
            "deployment": deployment}

def cleanup(made: dict) -> None:
    """Remove what ``berth_fixture`` made, usage records included."""
    UsageRecord.objects.filter(scope_path=made["project"].path).delete()
    made["deployment"].delete()
    for node in made["nodes"]:
        node.delete()
    made["client"].delete()
    for scope in (made["project"], made["team"], made["org"]):
        Contract.objects.filter(scope=scope).delete()
        scope.delete()
