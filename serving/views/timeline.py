"""The deployment page's timeline: each replica's states from its first event until now, as a bar
of segments a person reads at a glance (how long it took to load, when it slept, when it failed)."""

from __future__ import annotations

from django.utils.timesince import timesince


def timeline(deployment, events: list, now) -> dict | None:
    """``{"rows": [{"label", "segments": [{"state", "left", "width", "title"}]}], "start", "now"}``
    from ``events`` (the deployment's, oldest first), or None before the first. Percentages of the
    whole span; the last state of each replica lasts until ``now``."""
    mine = [e for e in events if e.replica_id is not None]
    if not mine:
        return None
    start = mine[0].at
    span = max((now - start).total_seconds(), 1.0)
    replicas = {r.pk: r for r in deployment.replica_set.all()}
    rows = []
    for replica_id in dict.fromkeys(e.replica_id for e in mine):
        changes = [e for e in mine if e.replica_id == replica_id]
        segments = []
        for event, following in zip(changes, [*changes[1:], None]):
            end = following.at if following is not None else now
            left = (event.at - start).total_seconds() / span * 100
            width = max((end - event.at).total_seconds() / span * 100, 0.4)  # a moment still shows
            until = "now" if following is None else f"{end:%H:%M:%S}"
            segments.append({"state": event.to_state, "left": f"{left:.2f}", "width": f"{min(width, 100 - left):.2f}",
                             "title": f"{event.to_state} from {event.at:%H:%M:%S} to {until} "
                                      f"({timesince(event.at, end)})"})
        replica = replicas.get(replica_id)
        label = f"{replica.node.name} · {str(replica.public_id)[:8]}" if replica else "a removed replica"
        rows.append({"label": label, "segments": segments})
    return {"rows": rows, "start": start, "now": now}
