"""After an agent restart: what an earlier agent left on this node is taken over — engines still
loading are watched again, interrupted starts failed, interrupted stops finished, and managed
engines running without any record adopted as ``unknown`` so a person sees them."""

from __future__ import annotations

import dataclasses
import logging
import uuid

from django.db import transaction

from scheduler.models import Node
from serving import queues
from serving.deployments import states
from serving.models import Deployment, DeploymentEvent, DeploymentState as S, Replica
from serving.node import failures
from serving.node.runtime import handle_of, runtime_for
from serving.runtimes.base import Handle

log = logging.getLogger(__name__)


def adopt(node: Node) -> None:
    """After an agent restart: loading engines whose process still runs are watched again; starts
    interrupted before their engine was up are failed, and stops interrupted are finished (what
    they held is given back, the engine is stopped); managed engines running without any record
    are adopted as ``unknown`` so a person sees and can stop them."""
    managed = _managed()
    adopt_orphans(node, managed)
    # A start interrupted between launching its engine and recording the handle left that engine
    # running with no handle on the row: the runtime still finds it by the replica's id.
    launched = {handle.replica_id: handle for handle in managed}
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node=node, state__in=(S.STARTING, S.LOADING, S.STOPPING)):
        handle = handle_of(replica) or launched.get(str(replica.public_id))
        if replica.state == S.STOPPING:
            exit = runtime_for(handle.runtime).stop(handle) if handle else None
            states.move(replica, S.STOPPED, "stopped once the agent restarted" + (f" ({exit.describe()})" if exit else ""))
        elif replica.state == S.LOADING and handle is not None and runtime_for(handle.runtime).status(handle).running:
            queues.to_node("watch", replica)
        else:
            failures.fail(replica, "the agent restarted before the engine was up", handle=handle)


def _managed() -> list[Handle]:
    """Every managed engine running on this node, of either runtime."""
    handles = []
    for kind in ("process", "docker"):
        try:
            handles += runtime_for(kind).managed()
        except Exception as error:  # a runtime this node does not have (no Docker daemon): nothing of it runs
            log.info("no %s engines to adopt: %s", kind, error)
    return handles


def adopt_orphans(node: Node, handles: list[Handle]) -> list[Replica]:
    adopted = []
    known = {str(r) for r in Replica.objects.filter(public_id__in=[h.replica_id for h in handles if _is_id(h.replica_id)])
             .values_list("public_id", flat=True)}
    for handle in handles:
        if not _is_id(handle.replica_id) or handle.replica_id in known:
            continue
        name, port = _served_name_and_port(handle)
        if port is None:
            log.warning("a managed engine (%s) runs without a record and without a readable port", handle)
            continue
        with transaction.atomic():
            deployment = Deployment.objects.create(
                name=name or f"unknown-{handle.replica_id[:8]}", model_path="", node=node,
                runtime=handle.runtime, state=S.UNKNOWN,
                state_detail="found running without a record: adopted; stop it or leave it")
            adopted.append(Replica.objects.create(public_id=handle.replica_id, deployment=deployment, node=node,
                                                  port=port, state=S.UNKNOWN, handle=dataclasses.asdict(handle)))
            DeploymentEvent.objects.create(deployment=deployment, replica=adopted[-1], to_state=S.UNKNOWN,
                                           message="a managed engine found running without a record")
    return adopted


def _is_id(value: str) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True


def _served_name_and_port(handle: Handle) -> tuple[str, int | None]:
    """What the engine serves and where, from its own command line (the only record left)."""
    argv: list[str] = []
    if handle.runtime == "process" and handle.pid:
        try:
            argv = open(f"/proc/{handle.pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            return "", None
    elif handle.runtime == "docker" and handle.container_id:
        container = runtime_for("docker").client.containers.get(handle.container_id)
        argv = list(container.attrs.get("Args") or [])
    def after(flag):
        return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else ""
    port = after("--port")
    return after("--alias") or after("--served-model-name"), int(port) if port.isdigit() else None
