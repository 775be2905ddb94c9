"""The agent's beat: on start-up it registers the node and adopts what an earlier agent left; then,
every few seconds, it re-registers the node (telemetry, engines), checks that engines which should
run still do, times out queued starts, admits the next one in line and runs the memory watchdog.
The Celery worker's signals start and stop it (``serving.tasks``)."""

from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from scheduler.models import Node
from serving.models import DeploymentState as S, Replica
from serving.models.states import RESIDENT
from serving.node import adopt, failures, lifecycle, watchdog
from serving.node.registration import register_local_node
from serving.node.runtime import handle_of, runtime_for

log = logging.getLogger(__name__)


def check_liveness(node: Node) -> None:
    """A replica that should be running whose engine exited or vanished moves to failed; a queued
    start that waited too long fails; a lost dispatch (agent restart) is sent again. Replicas
    failed while this node was lost (its beats late, the agent never stopped) are taken back or
    have their engines stopped, as after a restart (``adopt.take_back``)."""
    adopt.take_back(node)
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node=node, state__in=RESIDENT):
        handle = handle_of(replica)
        if handle is None:
            continue
        status = runtime_for(handle.runtime).status(handle)
        if not status.running:
            failures.fail(replica, f"engine {status.exit.describe() if status.exit else 'vanished'}", handle=handle,
                 exit=status.exit)
    cutoff = timezone.now() - timezone.timedelta(seconds=settings.SERVING_QUEUE_TIMEOUT_SECONDS)
    for replica in Replica.objects.select_related("deployment", "node").filter(node=node, state=S.QUEUED,
                                                                                queued_at__lt=cutoff):
        failures.fail(replica, f"waited more than {settings.SERVING_QUEUE_TIMEOUT_SECONDS // 60} min for a start-up slot")
    lifecycle.admit_next(node.pk)


def start_up() -> None:
    """Before the agent takes its first task: register the node and adopt what an earlier agent
    left (so a start it is about to receive is never mistaken for an interrupted one)."""
    adopt.adopt(register_local_node())
    close_old_connections()


def heartbeat_forever(stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            close_old_connections()
            node = register_local_node()
            check_liveness(node)
            watchdog.check(node)
        except Exception:  # a failed beat is logged and retried; it must not end the thread
            log.exception("agent heartbeat failed")
        stop.wait(settings.SERVING_HEARTBEAT_SECONDS)
