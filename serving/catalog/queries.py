"""The catalog as a caller sees it: the entries and fetch jobs within their reach, and with each
entry what runs it. The console's pages and the API's lists read through these."""

from __future__ import annotations

from django.db.models import Prefetch, Q

from serving.catalog import entries, room
from serving.models import Deployment, FetchJob, Replica
from tenancy import access


def held_entries(user, *, verdicts: bool = True):
    """The entries the caller may see, each with what runs it (``held``)."""
    return held(user, list(entries.visible_entries(user).prefetch_related("files")), verdicts=verdicts)


def held(caller, rows: list, *, verdicts: bool = True) -> list:
    """``rows`` (entries the caller may see) as Held shows them: each with its deployments, their
    replicas and nodes, and where it runs (``entry.placement``). What serves the entry's name is the
    model itself, whoever deployed it; a deployment that runs one of its files under another name is
    someone's own, shown only to those who may see it. A card or an API answer about one entry
    passes that one alone."""
    paths, names = {}, {}
    for entry in rows:
        for profile in entry.profiles:
            paths.setdefault(profile.get("file"), []).append(entry)
        names.setdefault(entry.name, []).append(entry)
        entry.deployments = []
    found = Deployment.objects.filter(Q(model_path__in=[p for p in paths if p]) | Q(name__in=list(names))) \
        .select_related("node").prefetch_related(Prefetch("replica_set", queryset=Replica.objects.select_related("node")))
    found = list(found)
    by_file = [d.pk for d in found if d.name not in names]
    seen = set(access.visible_owned(caller, Deployment.objects.filter(pk__in=by_file)).values_list("pk", flat=True)) \
        if by_file else set()
    for deployment in found:
        by_path = paths.get(deployment.model_path, []) if deployment.name in names or deployment.pk in seen else []
        for entry in {id(e): e for e in by_path + names.get(deployment.name, [])}.values():
            entry.deployments.append(deployment)
    known = room.placement_verdicts() if verdicts and rows else {}
    for entry in rows:
        entry.placement = room.placement(entry, known)
    return rows


def visible_jobs(user, queryset=None):
    """The fetch jobs of ``queryset`` (by default every one, with its owner) that the caller may see:
    those of scopes within their reach; ownerless ones are for administrators."""
    queryset = FetchJob.objects.select_related("owner") if queryset is None else queryset
    return access.visible_owned(user, queryset)
