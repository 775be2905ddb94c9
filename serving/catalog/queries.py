"""The catalog as a caller sees it: the entries and fetch jobs within their reach, and with each
entry what runs it. The console's pages and the API's lists read through these."""

from __future__ import annotations

from django.db.models import Prefetch, Q

from serving.catalog import entries, room
from serving.models import Deployment, FetchJob, Replica
from tenancy import access


def held_entries(user, *, verdicts: bool = True):
    """The entries the caller may see, each with its deployments (by the file a profile serves, or
    by name), their replicas and nodes, and where it runs (``entry.placement``)."""
    rows = list(entries.visible_entries(user).prefetch_related("files"))
    paths, names = {}, {}
    for entry in rows:
        for profile in entry.profiles:
            paths.setdefault(profile.get("file"), []).append(entry)
        names.setdefault(entry.name, []).append(entry)
        entry.deployments = []
    found = Deployment.objects.filter(Q(model_path__in=[p for p in paths if p]) | Q(name__in=list(names))) \
        .select_related("node").prefetch_related(Prefetch("replica_set", queryset=Replica.objects.select_related("node")))
    for deployment in found:
        for entry in {id(e): e for e in paths.get(deployment.model_path, []) + names.get(deployment.name, [])}.values():
            entry.deployments.append(deployment)
    known = room.placement_verdicts() if verdicts and rows else {}
    for entry in rows:
        entry.placement = room.placement(entry, known)
    return rows


def visible_jobs(user):
    queryset = FetchJob.objects.select_related("owner")
    if access.is_superuser(user):
        return queryset
    return access.visible_to(user, queryset.filter(owner__isnull=False), "owner")
