"""Measured generation speed per catalog profile, from the requests the gateway served.

The gateway hands each batch of usage rows to ``note`` with the usage write (off the request
path). A row that generated at least ``MIN_TOKENS`` tokens on a replica of a catalog model adds
its tokens and its generation time to that replica's profile: a streamed request counts the time
after its first token (decoding only), an unstreamed one its whole time after the queue (prompt
processing included — what its client saw). The sums fade: once they hold more than ``WINDOW_S``
seconds of generation both are scaled down to half of that, so the figure follows the recent past.

The placement policy reads ``measured()`` as each profile's tokens/s (``Profile.tokens_per_s``)
and, among profiles of equal priority, tries the fastest per accelerator or core first.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Iterable

from django.db import transaction

from serving.models import ProfileSpeed, Replica

log = logging.getLogger(__name__)
MIN_TOKENS = 8  # fewer say more about latency than about speed
WINDOW_S = 3600.0


def _sample(row: dict) -> tuple[str, float, float] | None:
    """(replica id, tokens, seconds) of one usage row, or None when it measures nothing."""
    tokens = row.get("completion_tokens") or 0
    if row.get("status") != 200 or not row.get("replica_id") or tokens < MIN_TOKENS or not row.get("total_ms"):
        return None
    if row.get("stream") and row.get("ttft_ms") is not None:
        tokens, ms = tokens - 1, row["total_ms"] - row["ttft_ms"]  # after the first token
    else:
        ms = row["total_ms"] - (row.get("queue_ms") or 0)
    return (str(row["replica_id"]), float(tokens), ms / 1000) if ms > 0 else None


def note(rows: Iterable[dict]) -> int:
    """Add a batch of usage rows to the profiles they ran on; how many rows counted."""
    samples = [s for s in map(_sample, rows) if s is not None]
    if not samples:
        return 0
    profile_of = {str(public_id): (name, profile) for public_id, name, profile in
                  Replica.objects.filter(public_id__in={s[0] for s in samples}).exclude(deployment__profile="")
                  .values_list("public_id", "deployment__name", "deployment__profile")}
    sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for replica, tokens, seconds in samples:
        if replica in profile_of:
            into = sums[profile_of[replica]]
            into[0], into[1], into[2] = into[0] + tokens, into[1] + seconds, into[2] + 1
    with transaction.atomic():
        for (model, profile), (tokens, seconds, count) in sorted(sums.items()):  # one lock order: no deadlock
            row, _ = ProfileSpeed.objects.select_for_update().get_or_create(model=model, profile=profile)
            row.tokens, row.seconds, row.requests = row.tokens + tokens, row.seconds + seconds, row.requests + count
            if row.seconds > WINDOW_S:
                fade = WINDOW_S / 2 / row.seconds
                row.tokens, row.seconds = row.tokens * fade, row.seconds * fade
            row.save()
    return int(sum(count for _, _, count in sums.values()))


def measured(models: Iterable[str] | None = None) -> dict[tuple[str, str], float]:
    """Tokens/s per (model, profile) where measured; ``models`` narrows the query."""
    rows = ProfileSpeed.objects.filter(seconds__gt=0)
    if models is not None:
        rows = rows.filter(model__in=list(models))
    return {(row.model, row.profile): row.tokens_per_second for row in rows}
