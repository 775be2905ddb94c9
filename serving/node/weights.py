"""A node fetching the mirror's weights it lacks, before a replica of them starts there
(``Deployment.transfers``, planned by ``serving.catalog.transfer``).

Each file goes to ``<to>.partial`` first, resumed from what is there with a byte range; it becomes
``<to>`` only once its SHA-256 equals the catalog's, and only then is it recorded as this node's
copy (``ModelFile`` with the node) — a half-finished file is never reported as held (discovery
reports weight suffixes, never ``.partial``). A mismatch is quarantined: the bytes are deleted, the
node's record says why, and the replica fails without starting. Free disk is checked first; when it
is short, copies no catalog model needs and no engine here uses are freed, oldest first, and if that
is not enough the replica fails naming the node and the figures. Progress is the deployment's
events, about every tenth of the way.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

import httpx
from django.conf import settings
from django.db.models import Q

from berth.errors import BerthError
from serving.catalog import transfer
from serving.catalog.entries import file_sha256
from serving.models import DeploymentEvent, ModelFile, Replica
from serving.models.states import SERVING
from serving.node import failures

log = logging.getLogger(__name__)
CHUNK = 1024 * 1024
DISK_MARGIN = 256 * 1024 * 1024  # left free beyond what the files need


class TransferFailed(BerthError):
    code = "weights_transfer_failed"


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def _say(replica: Replica, message: str) -> None:
    DeploymentEvent.objects.create(deployment=replica.deployment, replica=replica, from_state=replica.state,
                                   to_state=replica.state, message=message)


def ensure(replica: Replica) -> bool:
    """Fetch what the replica's node lacks; True when every file is here and verified. False when a
    file could not be fetched or did not verify: the replica has failed, saying why."""
    moves = replica.deployment.transfers or []
    try:
        for move in moves:
            _fetch(replica, move)
    except BerthError as error:
        failures.fail(replica, f"weights not on {replica.node.name}: {error.message}")
        return False
    return True


def _have(replica: Replica, move: dict) -> bool:
    to = Path(move["to"])
    copy = ModelFile.objects.filter(node=replica.node, path=str(to), verified=True, quarantined=False).first()
    return copy is not None and copy.sha256 == move["sha256"] and to.is_file() and to.stat().st_size == move["size"]


def _catalogs_own(move: dict) -> bool:
    """The destination is the catalog's own path and a file of its size lies there: this machine (or
    a shared disk) holds the control plane's verified file itself — not a copy to record or hash."""
    to = Path(move["to"])
    source = ModelFile.objects.filter(public_id=move["file"], node__isnull=True).values_list("path", flat=True).first()
    return source == str(to) and to.is_file() and to.stat().st_size == move["size"]


def _fetch(replica: Replica, move: dict) -> None:
    if _have(replica, move) or _catalogs_own(move):
        return
    to = Path(move["to"])
    to.parent.mkdir(parents=True, exist_ok=True)
    partial = to.with_name(to.name + ".partial")
    with open(partial, "ab") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # two starts of replicas of one model fetch it once
        if _have(replica, move):  # another start fetched it meanwhile
            partial.unlink(missing_ok=True)
            return
        if to.is_file() and to.stat().st_size == move["size"] and file_sha256(to) == move["sha256"]:
            _record(replica, move, to)  # already here (a copy made before it was recorded): only checked
            partial.unlink(missing_ok=True)
            return
        _room_for(replica, to.parent, move["size"] - partial.stat().st_size)
        _download(replica, move, partial)
        found = file_sha256(partial)
        if found != move["sha256"]:
            partial.unlink(missing_ok=True)
            _record(replica, move, to, found)
            raise TransferFailed(f"{move['repo_path'] or to.name} arrived with SHA-256 {found[:12]}…, not the "
                                 f"catalog's {move['sha256'][:12]}…; the copy is quarantined and the replica does "
                                 "not start")
        os.replace(partial, to)
    _record(replica, move, to)
    _say(replica, f"weights fetched: {move['repo_path'] or to.name} ({_gib(move['size'])}), SHA-256 verified")


def _download(replica: Replica, move: dict, partial: Path) -> None:
    url = f"{settings.SERVING_CONTROL_URL}/api/serving/mirror/files/{move['file']}/content/"
    have = partial.stat().st_size
    headers = {"Authorization": f"Bearer {transfer.link_for(move['file'], replica.node)}"}
    if have:
        headers["Range"] = f"bytes={have}-"
    total, said = move["size"] or 1, have * 10 // max(move["size"] or 1, 1)
    _say(replica, f"fetching weights: {move['repo_path']} ({_gib(move['size'])}"
                  + (f", resumed at {_gib(have)})" if have else ")"))
    try:
        with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(30, read=120)) as answer:
            if answer.status_code == 416:
                return  # all of it is here already
            if answer.status_code not in (200, 206):
                answer.read()
                raise TransferFailed(f"the control plane answered {answer.status_code} for "
                                     f"{move['repo_path']}: {answer.text[:300]}")
            mode = "ab" if answer.status_code == 206 else "wb"  # a 200 is the whole file again
            with open(partial, mode) as out:
                done = have if mode == "ab" else 0
                for chunk in answer.iter_bytes(CHUNK):
                    out.write(chunk)
                    done += len(chunk)
                    if done * 10 // total > said:
                        said = done * 10 // total
                        _say(replica, f"fetching weights: {_gib(done)} of {_gib(move['size'])}")
    except httpx.HTTPError as error:
        raise TransferFailed(f"the transfer of {move['repo_path']} from {settings.SERVING_CONTROL_URL} broke "
                             f"({error}); what arrived is kept and the next start resumes it") from error


def _record(replica: Replica, move: dict, to: Path, found: str | None = None) -> None:
    """The node's copy as it arrived: verified, or (``found``, another SHA-256) quarantined with why."""
    source = ModelFile.objects.filter(public_id=move["file"]).first()
    bad = found is not None and found != move["sha256"]
    ModelFile.objects.update_or_create(node=replica.node, path=str(to), defaults={
        "model": source.model if source else None, "repo_path": move["repo_path"], "size": move["size"],
        "sha256": found or move["sha256"], "expected_sha256": move["sha256"], "verified": not bad, "quarantined": bad,
        "quarantine_reason": f"its transfer to {replica.node.name} arrived with SHA-256 {found}, not {move['sha256']}"
        if bad else ""})


def _room_for(replica: Replica, where: Path, need: int) -> None:
    free = shutil.disk_usage(where).free
    if free >= need + DISK_MARGIN:
        return
    freed = collect_garbage(replica.node, need + DISK_MARGIN - free)
    free = shutil.disk_usage(where).free
    if free < need + DISK_MARGIN:
        raise TransferFailed(f"{replica.node.name} has {_gib(free)} of disk free under {where}, the weights need "
                             f"{_gib(need)} (and {_gib(DISK_MARGIN)} kept free); freeing copies no model needs "
                             f"gave back {_gib(freed)}")


def collect_garbage(node, want: int) -> int:
    """Free this node's copies that no catalog model needs (their model left the catalog) or that are
    quarantined, oldest first, never one an engine here uses nor a path the catalog's own file has,
    until ``want`` bytes are freed; the bytes freed. Files the node did not fetch (its own model
    directories) are never touched."""
    in_use = set(ModelFile.objects.filter(node__isnull=True).values_list("path", flat=True))  # the catalog's own
    for paths in replica_paths(node):
        in_use.update(paths)
    freed = 0
    for copy in ModelFile.objects.filter(Q(model__isnull=True) | Q(quarantined=True), node=node).order_by("created_at"):
        if freed >= want:
            break
        if copy.path in in_use:
            continue
        path = Path(copy.path)
        size = path.stat().st_size if path.is_file() else 0
        path.unlink(missing_ok=True)
        copy.delete()
        freed += size
        log.info("freed %s on %s (%s): no catalog model needs it", copy.path, node.name, _gib(size))
    return freed


def replica_paths(node):
    """The files the engines on ``node`` read (their transfers' destinations)."""
    for transfers in Replica.objects.filter(node=node, state__in=SERVING).values_list("deployment__transfers",
                                                                                       flat=True):
        yield [move["to"] for move in transfers or ()]
