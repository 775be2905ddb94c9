"""Console tables of the gateway app (``berth.tables.Table``)."""

from __future__ import annotations

from django.urls import reverse

from berth.tables import Column, Table, when
from gateway.batch.service import eta_seconds


def duration(seconds: int | None) -> str | None:
    """``3 h 05 min``, ``4 min 10 s``, ``12 s``; None (absent, not zero) when not known."""
    if seconds is None:
        return None
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def progress(batch) -> str:
    """Lines ended (completed and failed) of its total, and how many of them failed."""
    ended = batch.completed + batch.failed
    text = f"{ended:,} / {batch.total:,}"
    return f"{text} ({batch.failed:,} failed)" if batch.failed else text


def batch_link(batch) -> str:
    return reverse("gateway:batch", kwargs={"public_id": batch.public_id})


class BatchTable(Table):
    """The Batch API's batches, newest first. The view selects each batch's client with it."""

    columns = (
        Column("Batch", "public_id", link=batch_link),
        Column("Client", "client.name",
               link=lambda b: reverse("tenancy:client", kwargs={"public_id": b.client.public_id})),
        Column("Endpoint", "endpoint"),
        Column("Status", lambda b: b.get_status_display()),
        Column("Progress", progress, numeric=True,
               sort=lambda b: (b.completed + b.failed) / b.total if b.total else 0),
        Column("ETA", lambda b: duration(eta_seconds(b)), numeric=True, sort=lambda b: eta_seconds(b)),
        Column("Created", lambda b: when(b.created_at), sort="created_at"),
        Column("Expires", lambda b: when(b.expires_at), sort="expires_at"),
    )
    empty_message = ("No batches yet: a service client's key creates them with POST /v1/batches "
                     "(OpenAI's Batch API).")
