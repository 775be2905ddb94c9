"""The agent's engines on this node: its runtimes, and what a replica is launched with.

Shared by the node's halves (``lifecycle``, ``failures``, ``adopt``): one runtime object per kind
for the agent's life, and the one ``LaunchSpec`` a replica's engine is started and probed with.
"""

from __future__ import annotations

import os

from scheduler.models import Accelerator
from serving.engines.base import LaunchSpec
from serving.keys import replica_key
from serving.models import Replica
from serving.runtimes.base import Handle
from serving.runtimes.registry import runtime_for as make_runtime

_runtimes: dict = {}


def node_name() -> str | None:
    return os.environ.get("BERTH_AGENT_NODE")


def runtime_for(kind: str):
    """One runtime object per kind for the agent's life: a process runtime remembers the engines it
    started (their exit statuses reach only their parent)."""
    if kind not in _runtimes:
        _runtimes[kind] = make_runtime(kind)
    return _runtimes[kind]


def launch_spec(replica: Replica) -> LaunchSpec:
    deployment = replica.deployment
    node = replica.node
    accelerator = Accelerator.objects.filter(uuid__in=deployment.gpu_uuids).first() if deployment.gpu_uuids else None
    limit = deployment.memory_reserved_bytes
    return LaunchSpec(
        replica_id=str(replica.public_id), engine=deployment.engine, model_path=deployment.path_on_node,
        served_name=deployment.name, host="127.0.0.1" if node.address in ("127.0.0.1", "localhost") else node.address,
        port=replica.port, api_key=replica_key(replica.public_id), config=deployment.config, cores=deployment.cores,
        # The container limit leaves a quarter above the estimate: the estimate is what we plan
        # with, the limit is the line past which the kernel stops a runaway engine.
        memory_limit_bytes=int(limit * 1.25) if limit else None, gpu_uuids=tuple(deployment.gpu_uuids),
        gpu_memory_total_bytes=accelerator.memory_total_bytes if accelerator else None, reservation_bytes=limit,
        labels={"berth.managed": "true", "berth.deployment": str(deployment.public_id),
                "berth.replica": str(replica.public_id), "berth.model": deployment.name})


def handle_of(replica: Replica) -> Handle | None:
    return Handle(**replica.handle) if replica.handle else None


def base_url(replica: Replica) -> str:
    spec = launch_spec(replica)
    return f"http://{spec.host}:{spec.port}"
