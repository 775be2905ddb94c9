"""Leases in the database: one holder at a time for a loop that two processes must never both run
(the control loop: two beat processes, or two control workers, on one database).

A holder takes a free or expired lease, or renews its own, with one conditional UPDATE whose row
count decides (the first holder ever INSERTs, and the primary key decides between two firsts): never
check-then-act. The database's clock stamps and expires it, so contenders on machines whose clocks
differ agree. It lives in the database rather than Redis because the embedded default has no Redis
(and its file cache has no atomic add); one row, read and written once a pass, costs nothing.

Imports no app (``berth.health`` and the metrics read it; ``serving.control.reconcile`` holds it).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now

from berth.models import Lease

CONTROL_LOOP = "control-loop"
# The process as the lease names it, taken when this module is first imported. A Celery worker
# imports its tasks (and so this) before it forks its pool, so every child of one worker is the same
# holder, named by the worker's own pid, and a pass landing on another child is not a contender.
_IDENTITY = f"{socket.gethostname()}:{os.getpid()}"


def identity() -> str:
    """host:pid of this process (of the Celery worker, for its pool's children)."""
    return _IDENTITY


@dataclass(frozen=True)
class Held:
    """A lease as read: who holds it, since when, last renewed and expiring when (database times),
    and the database's now at the reading, so ages need no local clock."""

    name: str
    holder: str
    acquired_at: datetime
    renewed_at: datetime
    expires_at: datetime
    now: datetime

    @property
    def expired(self) -> bool:
        return self.expires_at <= self.now

    @property
    def age_s(self) -> float:
        """Seconds this holder has held it."""
        return max(0.0, (self.now - self.acquired_at).total_seconds())

    @property
    def renewed_age_s(self) -> float:
        return max(0.0, (self.now - self.renewed_at).total_seconds())


def _after(seconds: float):
    return Now() + Value(timedelta(seconds=seconds))


def claim(name: str, holder: str, ttl_s: float) -> tuple[bool, Held]:
    """Take ``name`` for ``holder`` for ``ttl_s`` seconds (when free or expired) or renew it (when
    ``holder`` has it). Returns whether ``holder`` holds it now, and the lease as it stands."""
    taken = Lease.objects.filter(name=name).filter(Q(holder=holder) | Q(expires_at__lte=Now())).update(
        acquired_at=Case(When(holder=holder, then=F("acquired_at")), default=Now()),
        holder=holder, renewed_at=Now(), expires_at=_after(ttl_s))
    if not taken:
        try:
            with transaction.atomic():  # a savepoint: a caller's transaction survives losing the race
                Lease.objects.create(name=name, holder=holder, acquired_at=Now(), renewed_at=Now(),
                                     expires_at=_after(ttl_s))
            taken = 1
        except IntegrityError:
            pass  # another process took it first (its row, not yet expired)
    held = read(name)
    return bool(taken) and held is not None and held.holder == holder, held


def read(name: str) -> Held | None:
    """The lease as it stands (expired or not), or None when nobody ever took it."""
    row = Lease.objects.filter(name=name).annotate(db_now=Now()).values_list(
        "holder", "acquired_at", "renewed_at", "expires_at", "db_now").first()
    if row is None:
        return None
    return Held(name, *row)


def release(name: str, holder: str) -> bool:
    """Give ``name`` up now, if ``holder`` has it (a clean shutdown hands over at once)."""
    return bool(Lease.objects.filter(name=name, holder=holder).update(expires_at=Now()))
