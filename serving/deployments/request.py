"""What a deployment is asked to be: one ``DeployRequest``, built by every caller the same way.

A request crosses process boundaries (a switch is recorded, then carried out by the control
worker), so it has one written form (``as_json``/``from_json``) that keeps every field: a copy
that dropped the accelerator or the shards would start B on the CPU. ``of(deployment)`` is the
request a running deployment would be made from, for the verbs that replace it with a changed copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from scheduler.models import Accelerator, Node
from serving.errors import InvalidDeployment
from serving.models import Deployment
from tenancy.models import Scope


@dataclasses.dataclass(frozen=True)
class DeployRequest:
    name: str
    model_path: str
    node: Node
    engine: str = Deployment.Engine.LLAMACPP
    runtime: str = Deployment.Runtime.PROCESS
    task: str = Deployment.Task.CHAT
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    accelerator: Accelerator | None = None
    # A tensor-parallel replica's further accelerators, on the same node: a shard on each.
    shards: tuple[Accelerator, ...] = ()
    owner: Scope | None = None
    priority: int = 50
    cores: int | None = None
    # The placement loop adds replicas of a catalog model: more than one deployment serves its name.
    another_replica: bool = False
    # Replicas stopped to make room for this one (preemption): it starts once they have stopped.
    waits_for: tuple[str, ...] = ()
    profile: str = ""  # the catalog profile it runs ("" when deployed by hand)
    # Where its node finds the model, and the mirror's files it fetches first (serving.catalog.transfer).
    node_path: str = ""
    transfers: tuple[dict, ...] = ()

    @property
    def accelerators(self) -> tuple[Accelerator, ...]:
        """Every accelerator it takes, the one its estimate is for first; empty on the CPU."""
        return (self.accelerator, *self.shards) if self.accelerator is not None else ()

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "model_path": self.model_path, "node": self.node.name, "engine": self.engine,
                "runtime": self.runtime, "task": self.task, "config": self.config,
                "accelerators": [a.uuid for a in self.accelerators], "owner": self.owner.pk if self.owner else None,
                "priority": self.priority, "cores": self.cores, "another_replica": self.another_replica,
                "waits_for": list(self.waits_for), "profile": self.profile, "node_path": self.node_path,
                "transfers": list(self.transfers)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeployRequest:
        """The request ``as_json`` wrote; refused (naming what is gone) when its node, accelerators or
        owner no longer exist, rather than quietly deploying something else."""
        node = Node.objects.filter(name=data["node"]).first()
        if node is None:
            raise InvalidDeployment(f"Node {data['node']!r} no longer exists.", details={"node": "gone"})
        accelerators = _accelerators(node, data.get("accelerators") or [])
        owner = None
        if data.get("owner") is not None:
            owner = Scope.objects.filter(pk=data["owner"]).first()
            if owner is None:
                raise InvalidDeployment("The owner scope no longer exists.", details={"owner": "gone"})
        return cls(name=data["name"], model_path=data["model_path"], node=node, engine=data["engine"],
                   runtime=data["runtime"], task=data["task"], config=dict(data.get("config") or {}),
                   accelerator=accelerators[0] if accelerators else None, shards=tuple(accelerators[1:]),
                   owner=owner, priority=data.get("priority", 50), cores=data.get("cores"),
                   another_replica=bool(data.get("another_replica")), waits_for=tuple(data.get("waits_for") or ()),
                   profile=data.get("profile") or "", node_path=data.get("node_path") or "",
                   transfers=tuple(data.get("transfers") or ()))

    @classmethod
    def of(cls, deployment: Deployment, **changes) -> DeployRequest:
        """The request ``deployment`` was made from (its accelerators, shards, profile and all), with
        ``changes`` applied: what a switch or a reconfigure starts as B unless told otherwise."""
        accelerators = _accelerators(deployment.node, deployment.gpu_uuids or [])
        request = cls(name=deployment.name, model_path=deployment.model_path, node=deployment.node,
                      engine=deployment.engine, runtime=deployment.runtime, task=deployment.task,
                      config=dict(deployment.config), accelerator=accelerators[0] if accelerators else None,
                      shards=tuple(accelerators[1:]), owner=deployment.owner, priority=deployment.priority,
                      cores=deployment.cores, profile=deployment.profile)
        if "model_path" not in changes:  # the same files: its node's copy of them too
            request = dataclasses.replace(request, node_path=deployment.node_path,
                                          transfers=tuple(deployment.transfers or ()))
        return dataclasses.replace(request, **changes)


def _accelerators(node: Node, uuids: list[str]) -> list[Accelerator]:
    """The node's accelerators of ``uuids``, in that order; refused when one is gone."""
    found = {a.uuid: a for a in Accelerator.objects.filter(node=node, uuid__in=uuids)}
    missing = [uuid for uuid in uuids if uuid not in found]
    if missing:
        raise InvalidDeployment(f"{len(missing)} accelerator(s) of this deployment are no longer on {node.name}.",
                                details={"accelerators": missing})
    return [found[uuid] for uuid in uuids]
