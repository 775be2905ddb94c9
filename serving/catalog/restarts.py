"""A catalog model's rolling restart: each of its replicas is replaced, one at a time, by a new one
started afresh (its profile, file and settings as the catalog holds them now), the new one ready
before the old stops — so a model with two replicas or more keeps serving throughout.

Asking writes the moment (``ModelEntry.restart_requested_at``); the placement policy does the rest
(``scheduler.policy.plan.leaving_replicas``): the oldest replica started before that moment leaves
next, and the pass says where each stands — waiting for its replacement, or blocked, and why (no
room for a second copy, a quota) — in ``scheduler.placement_service.moves``. The same rules as a
change of the model's placement say who may ask (``placing.require_change``).
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from scheduler import placement_service
from serving import queues
from serving.catalog.errors import NothingToRestart
from serving.catalog.placing import require_change
from serving.models import ModelEntry, Replica
from serving.models.states import COUNTING
from tenancy import audit
from tenancy.audit import Actor


def _replicas(entry: ModelEntry):
    return Replica.objects.filter(deployment__name=entry.name, state__in=COUNTING)


def restart(actor: Actor, entry: ModelEntry) -> ModelEntry:
    """Ask for a rolling restart of every replica running or starting now. 409 ``nothing_to_restart``
    when there is none; asked again while one is under way, it covers the replicas started since too."""
    require_change(actor, entry)
    with transaction.atomic():
        entry = ModelEntry.objects.select_for_update().get(pk=entry.pk)
        count = _replicas(entry).count()
        if not count:
            raise NothingToRestart(f"{entry.name} has no replica running or starting: there is nothing to restart.",
                                   details={"model": entry.name})
        entry.restart_requested_at = timezone.now()
        entry.save(update_fields=["restart_requested_at", "updated_at"])
        audit.record(actor, "catalog.model.restart", entry, scope=entry.owner,
                     details={"name": entry.name, "replicas": count})
        queues.reconcile_soon()
    return entry


def progress(entry: ModelEntry) -> dict[str, Any] | None:
    """Where the model's last rolling restart stands: when it was asked, how many replicas started
    before it still run, and the last pass's word on the one leaving now. None when none was asked
    or it is done."""
    asked = entry.restart_requested_at
    if asked is None:
        return None
    left = _replicas(entry).filter(created_at__lt=asked).count()
    if not left:
        return None
    moves = placement_service.moves(models={entry.name})
    leaving = [m for m in moves or () if m.why == "restart"]
    return {"requested_at": asked, "replicas_left": left,
            "state": leaving[0].state if leaving else "waiting",
            "detail": leaving[0].detail if leaving else "waits for the next placement pass",
            "moves_known": moves is not None}
