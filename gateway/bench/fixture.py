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


def berth_fixture(stub_port: int) -> dict:
    """A tenant (org, team, project) with a key and limits on every level, and a ready deployment
    whose one replica is the stub engine on ``stub_port``."""
    actor = Actor(system="bench")
    slug = "bench-" + uuid.uuid4().hex[:8]
    org = tree.create_scope(actor, "org", slug, "Bench")
    team = tree.create_scope(actor, "team", "team", "Team", org)
    project = tree.create_scope(actor, "project", "project", "Project", team)
    big = {"rpm_limit": 10**9, "tpm_limit": 2 * 10**9, "concurrency_limit": 10**6}
    for scope in (org, team, project):
        contracts.set_contract(actor, scope, daily_token_budget=10**15, monthly_token_budget=10**16, **big)
    client = clients.create_client(actor, project, "bench", all_models=True, access="inference", **big)
    _, key = clients.create_credential(actor, client)
    node = register_node(NodeReport(name=f"{slug}-node", address="127.0.0.1"))
    # The stub answers any number at once: as many slots as llama.cpp takes, so the gateway's slot gate
    # (gateway.slots) never holds a request back and what is measured is the gateway's own cost.
    deployment = Deployment.objects.create(name="bench-model", model_path="/stub", node=node, state="ready",
                                           config={"parallel": 256})
    Replica.objects.create(deployment=deployment, node=node, port=stub_port, state="ready")
    return {"key": key, "org": org, "team": team, "project": project, "client": client, "node": node,
            "deployment": deployment}

def cleanup(made: dict) -> None:
    """Remove what ``berth_fixture`` made, usage records included."""
    UsageRecord.objects.filter(scope_path=made["project"].path).delete()
    made["deployment"].delete()
    made["node"].delete()
    made["client"].delete()
    for scope in (made["project"], made["team"], made["org"]):
        Contract.objects.filter(scope=scope).delete()
        scope.delete()
