"""A node's heartbeat, as the control plane takes it: the node's own report (telemetry, GPUs,
engines installed, weights held) registers it again; the engines its agent manages say which
replicas still run. Every few seconds (``SERVING_HEARTBEAT_SECONDS``, the agent's pace):

- the first beat after an agent started adopts what an earlier agent left (``adopt.adopt``) and
  returns that agent's leased jobs to the queue (they died with it);
- a replica that should be running whose engine exited or vanished moves to failed, with the log
  tail the node sent; replicas failed while the node was lost are taken back or have their engines
  stopped (``adopt.take_back``);
- a queued start that waited too long fails; the next in line is admitted; the memory watchdog
  looks at the node's figures.

The answer tells the agent which engines the control plane expects to run, so the next beat says
how each one is."""

from __future__ import annotations

import dataclasses
import logging

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from scheduler.models import Node
from serving.control import adopt, failures, node_jobs, node_work, watchdog
from serving.models import DeploymentState as S, Replica
from serving.models.states import RESIDENT
from serving.runtimes.base import EngineSeen, Handle

log = logging.getLogger(__name__)


def beat(node: Node, seen: list[EngineSeen], *, first: bool, agent: str = "") -> dict:
    """Take a heartbeat of ``node`` (registered again by the caller) and what its agent ``seen``;
    ``agent``: the agent's instance, which its first beat makes the node's."""
    by_replica = {engine.handle.replica_id: engine for engine in seen}
    if first:
        if agent:
            node_jobs.note_agent(node, agent)
        returned = node_jobs.return_leases(node, "the node's agent restarted")
        if returned:
            log.info("%s: %d job(s) its earlier agent had leased are queued again", node.name, returned)
        adopt.adopt(node, by_replica)
    else:
        adopt.take_back(node, by_replica)
    check_liveness(node, by_replica)
    cutoff = timezone.now() - timezone.timedelta(seconds=settings.SERVING_QUEUE_TIMEOUT_SECONDS)
    for replica in Replica.objects.select_related("deployment", "node").filter(node=node, state=S.QUEUED,
                                                                                queued_at__lt=cutoff):
        failures.record(replica, f"waited more than {settings.SERVING_QUEUE_TIMEOUT_SECONDS // 60} min for a "
                                 "start-up slot")
    node_work.admit_next(node.pk)
    watchdog.check(node)
    return {"expected": expected(node)}


def check_liveness(node: Node, seen: dict[str, EngineSeen]) -> None:
    """A replica that should be running whose engine the node reports exited or vanished fails,
    with the engine's log tail. One the node did not report this beat waits for the next."""
    for replica in Replica.objects.select_related("deployment", "node").filter(node=node, state__in=RESIDENT) \
            .exclude(handle={}):
        engine = seen.get(str(replica.public_id))
        if engine is None or engine.running:
            continue
        failures.record(replica, f"engine {engine.exit.describe() if engine.exit else 'vanished'}",
                        log_tail=engine.log_tail, exit=engine.exit)


def expected(node: Node) -> list[dict]:
    """The handles of the node's engines that should be running (resident, loading or stopping), and
    of those whose replicas failed while the node was lost (``adopt.take_back`` settles each once the
    node says whether its engine still runs)."""
    rows = Replica.objects.filter(Q(state__in=(*RESIDENT, S.LOADING, S.STOPPING))
                                  | Q(state=S.FAILED, exit_reason__startswith=adopt.LOST.format(name=node.name)),
                                  node=node).exclude(handle={}).values_list("handle", flat=True)
    return [dataclasses.asdict(Handle(**handle)) for handle in rows if handle]
