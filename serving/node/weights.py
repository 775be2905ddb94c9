"""A node fetching the mirror's weights it lacks, before a replica of them starts there
(``Deployment.transfers``, planned by ``serving.catalog.transfer``; the start job lists them, each
with a link that lets this node fetch that one file).

Each file goes to ``<to>.partial`` first, resumed from what is there with a byte range; it becomes
``<to>`` only once its SHA-256 equals the catalog's, and only then is it reported as this node's
copy (the control plane records it) — a half-finished file is never reported as held (discovery
reports weight suffixes, never ``.partial``). A mismatch is quarantined: the bytes are deleted, the
report says what arrived, and the replica fails without starting. Free disk is checked first; when
it is short, the copies the control plane listed as freeable (no catalog model needs them, no
engine here uses them) are freed, oldest first, and if that is not enough the replica fails naming
the node and the figures. Progress is the deployment's events, about every tenth of the way.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

import httpx

from berth.errors import BerthError
from serving.engines.model_files import file_sha256

log = logging.getLogger(__name__)
CHUNK = 1024 * 1024
DISK_MARGIN = 256 * 1024 * 1024  # left free beyond what the files need


class TransferFailed(BerthError):
    code = "weights_transfer_failed"


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def _have(move: dict) -> bool:
    to = Path(move["to"])
    return (move.get("recorded") or move.get("catalogs_own")) and to.is_file() and to.stat().st_size == move["size"]


def fetch(job, move: dict, freeable) -> None:
    """Make sure ``move``'s file is here and verified, fetching it when it is not; raises
    ``TransferFailed`` (or another ``BerthError``) saying why it could not be."""
    if _have(move):
        return
    to = Path(move["to"])
    to.parent.mkdir(parents=True, exist_ok=True)
    partial = to.with_name(to.name + ".partial")
    with open(partial, "ab") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # two starts of replicas of one model fetch it once
        if to.is_file() and to.stat().st_size == move["size"] and file_sha256(to) == move["sha256"]:
            partial.unlink(missing_ok=True)  # here already (another start fetched it, or a copy made earlier)
            job.report("weights", {"to": str(to), "sha256": move["sha256"]})
            return
        _room_for(job, to.parent, move["size"] - partial.stat().st_size, freeable)
        _download(job, move, partial)
        found = file_sha256(partial)
        if found != move["sha256"]:
            partial.unlink(missing_ok=True)
            job.report("weights", {"to": str(to), "sha256": found})
            raise TransferFailed(f"{move['repo_path'] or to.name} arrived with SHA-256 {found[:12]}…, not the "
                                 f"catalog's {move['sha256'][:12]}…; the copy is quarantined and the replica does "
                                 "not start")
        os.replace(partial, to)
    job.report("weights", {"to": str(to), "sha256": found})
    job.report("say", {"message": f"weights fetched: {move['repo_path'] or to.name} ({_gib(move['size'])}), "
                                  "SHA-256 verified"})


def _download(job, move: dict, partial: Path) -> None:
    client = job.client
    url = f"{client.server}/api/serving/mirror/files/{move['file']}/content/"
    have = partial.stat().st_size
    headers = {"Authorization": f"Bearer {move['link']}"}
    if have:
        headers["Range"] = f"bytes={have}-"
    total, said = move["size"] or 1, have * 10 // max(move["size"] or 1, 1)
    job.report("say", {"message": f"fetching weights: {move['repo_path']} ({_gib(move['size'])}"
                                  + (f", resumed at {_gib(have)})" if have else ")")})
    try:
        with httpx.stream("GET", url, headers=headers, verify=client.verify,
                          timeout=httpx.Timeout(30, read=120)) as answer:
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
                        job.report("say", {"message": f"fetching weights: {_gib(done)} of {_gib(move['size'])}"})
    except httpx.HTTPError as error:
        raise TransferFailed(f"the transfer of {move['repo_path']} from {client.server} broke "
                             f"({error}); what arrived is kept and the next start resumes it") from error


def _room_for(job, where: Path, need: int, freeable) -> None:
    free = shutil.disk_usage(where).free
    if free >= need + DISK_MARGIN:
        return
    freed = collect_garbage(job, freeable, need + DISK_MARGIN - free)
    free = shutil.disk_usage(where).free
    if free < need + DISK_MARGIN:
        raise TransferFailed(f"this node has {_gib(free)} of disk free under {where}, the weights need "
                             f"{_gib(need)} (and {_gib(DISK_MARGIN)} kept free); freeing copies no model needs "
                             f"gave back {_gib(freed)}")


def collect_garbage(job, freeable, want: int) -> int:
    """Free the copies the control plane listed (oldest first) until ``want`` bytes are freed; the
    bytes freed. The files freed are reported, so the control plane forgets those copies."""
    freed, paths = 0, []
    for name in freeable:
        if freed >= want:
            break
        path = Path(name)
        size = path.stat().st_size if path.is_file() else 0
        path.unlink(missing_ok=True)
        paths.append(name)
        freed += size
        log.info("freed %s (%s): no catalog model needs it", name, _gib(size))
    if paths:
        job.report("freed", {"paths": paths})
    return freed
