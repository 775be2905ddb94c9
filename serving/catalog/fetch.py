"""Fetching a hub repository's files into the mirror: refused before anything is downloaded when
it cannot end well, resumable when interrupted, every file checked against the hash the hub
publishes. A file whose hash differs is quarantined and never reaches the catalog."""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import logging
import shutil
import time
from pathlib import Path

import requests
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from huggingface_hub.utils import build_hf_headers, get_session

from berth.errors import BerthError, InvalidInput
from serving import queues
from serving.catalog import entries, hub, validation
from serving.catalog.errors import FetchRefused
from serving.catalog.paths import local_path, mirror_root, quarantine_root
from serving.models import FetchJob, ModelFile
from tenancy import access, audit
from tenancy.audit import Actor

log = logging.getLogger(__name__)
CHUNK = 1024 * 1024
PROGRESS_EVERY_SECONDS = 0.5


def free_bytes(path: Path) -> int:
    """Free space on the filesystem that holds ``path`` (tests point this at a tiny figure)."""
    path = Path(path)
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


@dataclasses.dataclass(frozen=True)
class FetchRequest:
    repo: str
    revision: str = "main"
    quant: str | None = None
    file: str | None = None
    patterns: tuple[str, ...] = ()
    allow_pickle: bool = False
    name: str | None = None
    owner: object | None = None  # a tenancy Scope; None = shared (administrators only)


@dataclasses.dataclass(frozen=True)
class Plan:
    repository: hub.Repository
    files: tuple[hub.HubFile, ...]
    quantisation: str
    format: str
    missing_bytes: int


def plan(actor: Actor, request: FetchRequest) -> Plan:
    """What would be fetched, or the reason it will not be — nothing is downloaded here."""
    if not validation.REPO.match(request.repo or "") or ".." in request.repo:
        raise InvalidInput("A repository looks like owner/name.", details={"repo": request.repo})
    _require_catalog_rights(actor, request.owner)
    repository = hub.repository(request.repo, request.revision or "main")

    def refuse(reason: str, message: str):
        raise FetchRefused(message, details={"reason": reason, "repo": request.repo, "commit": repository.commit})

    if repository.needs_remote_code:
        refuse("remote_code", f"{request.repo} needs remote code (custom_code) to load: Berth does not run code "
                              "from model repositories.")
    if repository.pickle_only:
        allowed = request.allow_pickle and access.is_superuser(actor) and settings.SERVING_MIRROR_ALLOW_PICKLE
        if not allowed:
            refuse("pickle_only", f"{request.repo} ships its weights only as pickle files, which can run code when "
                                  "loaded; an administrator may allow it where BERTH_MIRROR_ALLOW_PICKLE is on.")
    if request.patterns:
        chosen = tuple(f for f in repository.files if any(fnmatch.fnmatch(f.path, p) for p in request.patterns))
        if not chosen:
            refuse("no_files", f"No file of {request.repo} matches {', '.join(request.patterns)}.")
        gguf = [f for f in chosen if f.path.lower().endswith(".gguf")]
        quantisation = hub.quantisation_of(gguf[0].path) if gguf else ""
        fmt = "gguf" if gguf else "safetensors"
    else:
        chosen_set = hub.choose_set(repository.files, request.quant, request.file)
        chosen, quantisation, fmt = chosen_set.files, chosen_set.quantisation, chosen_set.format
    if repository.gated and not hub.has_access(repository):
        refuse("gated", f"{request.repo} is gated and this mirror's token has not been granted access "
                        "(set HF_TOKEN to an account that was).")
    missing = 0
    for file in chosen:
        target = local_path(repository.repo, repository.commit, file.path)
        have = target.stat().st_size if target.exists() else _partial(target).stat().st_size if _partial(target).exists() else 0
        missing += max(0, (file.size or 0) - have)
    free = free_bytes(mirror_root())
    margin = settings.SERVING_MIRROR_DISK_MARGIN_BYTES
    if missing + margin > free:
        refuse("disk", f"Not enough disk: {request.repo} needs {missing:,} bytes more and {free:,} are free "
                       f"(keeping {margin:,} spare).")
    return Plan(repository=repository, files=tuple(chosen), quantisation=quantisation, format=fmt,
                missing_bytes=missing)


def start(actor: Actor, request: FetchRequest, *, kind: str = FetchJob.Kind.FETCH, options: dict | None = None,
          enqueue: bool = True) -> FetchJob:
    """Plan (refusing with the reason), then record the job and hand it to the worker once committed."""
    planned = plan(actor, request)
    with transaction.atomic():
        job = FetchJob.objects.create(
            kind=kind, repo=planned.repository.repo, revision=request.revision or "main",
            commit=planned.repository.commit, owner=request.owner, created_by=actor.user,
            files=[{"path": f.path, "size": f.size, "sha256": f.sha256, "blob_id": f.blob_id, "done_bytes": 0,
                    "state": "waiting"} for f in planned.files],
            options={"name": request.name or "", "quantisation": planned.quantisation, "format": planned.format,
                     **(options or {})})
        audit.record(actor, "catalog.fetch", job, scope=request.owner, details={
            "repo": job.repo, "commit": job.commit, "files": [f.path for f in planned.files]})
        if enqueue:
            transaction.on_commit(lambda: enqueue_job(job))
    return job


def enqueue_job(job: FetchJob) -> None:
    queues.to_control(queues.RUN_FETCH_JOB, str(job.public_id))


def resume(actor: Actor, job: FetchJob, *, enqueue: bool = True) -> FetchJob:
    """Run a failed fetch again: what arrived stays, each file continues where it stopped. It takes
    what starting it took (a viewer may follow a fetch, not run it)."""
    _require_catalog_rights(actor, job.owner)
    if job.status not in (FetchJob.Status.FAILED,):
        raise BerthError(f"The fetch is {job.status}: only a failed fetch resumes.", code="fetch_not_resumable",
                         status=409)
    FetchJob.objects.filter(pk=job.pk).update(status=FetchJob.Status.QUEUED, error="")
    audit.record(actor, "catalog.fetch.resume", job, scope=job.owner, details={"repo": job.repo})
    job.refresh_from_db()
    if enqueue:
        transaction.on_commit(lambda: enqueue_job(job))
    return job


def run(job: FetchJob) -> FetchJob:
    """Download, verify and record each file of ``job``; on success, the catalog entry."""
    claimed = FetchJob.objects.filter(pk=job.pk, status=FetchJob.Status.QUEUED).update(
        status=FetchJob.Status.RUNNING, started_at=timezone.now())
    if not claimed:  # another worker has it, or it already ended
        job.refresh_from_db()
        return job
    job.refresh_from_db()
    _log(job, f"fetching {len(job.files)} file(s) of {job.repo} at {job.commit}")
    try:
        for index, file in enumerate(job.files):
            _fetch_file(job, index, file)
        bad = [f for f in job.files if f["state"] == "quarantined"]
        if bad:
            raise BerthError(f"{', '.join(f['path'] for f in bad)}: SHA-256 differs from what the hub publishes; "
                             "the file is quarantined and will not be served.", code="hash_mismatch", status=502)
        entry = entries.register_fetched(job)
        _finish(job, FetchJob.Status.DONE, result={"model": entry.name, "fingerprint": entry.fingerprint})
        FetchJob.objects.filter(pk=job.pk).update(model=entry)
    except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as error:
        _finish(job, FetchJob.Status.FAILED, error=f"The download was interrupted ({error.__class__.__name__}); "
                                                   "resume it to continue where it stopped.")
    except BerthError as error:
        _finish(job, FetchJob.Status.FAILED, error=error.message)
    job.refresh_from_db()
    return job


def _partial(target: Path) -> Path:
    return target.with_name(target.name + ".part")


def _fetch_file(job: FetchJob, index: int, file: dict) -> None:
    target = local_path(job.repo, job.commit, file["path"])
    size = file.get("size")
    if target.exists() and (size is None or target.stat().st_size == size):
        _log(job, f"{file['path']}: already present")
    else:
        _download(job, index, file, target)
    _verify(job, index, file, target)


def _download(job: FetchJob, index: int, file: dict, target: Path) -> None:
    partial = _partial(target)
    partial.parent.mkdir(parents=True, exist_ok=True)
    offset = partial.stat().st_size if partial.exists() else 0
    headers = build_hf_headers(token=hub.token())
    headers["Accept-Encoding"] = "identity"
    if offset:
        headers["Range"] = f"bytes={offset}-"
        _log(job, f"{file['path']}: resuming at byte {offset:,}")
    _set_file(job, index, state="downloading", done_bytes=offset)
    url = hub.file_url(job.repo, job.commit, file["path"])
    with get_session().get(url, headers=headers, stream=True, timeout=settings.SERVING_HUB_TIMEOUT) as response:
        if response.status_code == 416 and offset:  # the partial file is already whole
            pass
        else:
            if response.status_code not in (200, 206):
                raise BerthError(f"{file['path']}: the hub answered {response.status_code}.", code="fetch_failed",
                                 status=502)
            mode = "ab" if offset and response.status_code == 206 else "wb"
            done = offset if mode == "ab" else 0
            last = time.monotonic()
            with open(partial, mode) as handle:
                for chunk in response.iter_content(CHUNK):
                    handle.write(chunk)
                    done += len(chunk)
                    if time.monotonic() - last >= PROGRESS_EVERY_SECONDS:
                        _set_file(job, index, done_bytes=done)
                        last = time.monotonic()
                    if file.get("size") is not None and done > file["size"]:
                        raise BerthError(f"{file['path']}: more bytes than the hub said it holds.",
                                         code="fetch_failed", status=502)
                    _set_file_unsaved(job, index, done)
            _set_file(job, index, done_bytes=done)
    if file.get("size") is not None and partial.stat().st_size != file["size"]:
        # Keep what arrived: the next run resumes from here.
        raise requests.exceptions.ChunkedEncodingError(f"{partial.stat().st_size} of {file['size']} bytes")
    partial.replace(target)


def _verify(job: FetchJob, index: int, file: dict, target: Path) -> None:
    digest = hashlib.sha256()
    blob = hashlib.sha1()
    blob.update(f"blob {target.stat().st_size}\0".encode())
    with open(target, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            blob.update(chunk)
    actual = digest.hexdigest()
    expected = (file.get("sha256") or "").lower()
    if expected:
        good = actual == expected
    else:  # a small file kept in git: the hub publishes its git blob id
        good = not file.get("blob_id") or blob.hexdigest() == file["blob_id"].lower()
    record_path = target
    if not good:
        record_path = quarantine_root() / job.repo / job.commit / file["path"]
        record_path.parent.mkdir(parents=True, exist_ok=True)
        target.replace(record_path)
        _log(job, f"{file['path']}: SHA-256 {actual} differs from the hub's {expected or file.get('blob_id')}: "
                  "quarantined")
    else:
        _log(job, f"{file['path']}: verified (sha256 {actual[:16]}…)")
    ModelFile.objects.update_or_create(
        node=None, path=str(record_path),
        defaults={"repo_path": file["path"], "size": target.stat().st_size if good else record_path.stat().st_size,
                  "sha256": actual, "expected_sha256": expected, "verified": good, "quarantined": not good,
                  "quarantine_reason": "" if good else "SHA-256 differs from the hub's"})
    _set_file(job, index, state="verified" if good else "quarantined", sha256_actual=actual)


def _set_file_unsaved(job: FetchJob, index: int, done: int) -> None:
    job.files[index]["done_bytes"] = done


def _set_file(job: FetchJob, index: int, **changes) -> None:
    job.files[index].update(changes)
    FetchJob.objects.filter(pk=job.pk).update(files=job.files)


def _log(job: FetchJob, line: str) -> None:
    stamp = timezone.now().strftime("%H:%M:%S")
    job.log = f"{job.log}{stamp} {line}\n"
    FetchJob.objects.filter(pk=job.pk).update(log=job.log)


def _finish(job: FetchJob, status: str, *, error: str = "", result: dict | None = None) -> None:
    if error:
        _log(job, error)
    FetchJob.objects.filter(pk=job.pk).update(status=status, error=error, result=result or {},
                                              finished_at=timezone.now(), files=job.files)


def _require_catalog_rights(actor: Actor, owner) -> None:
    if owner is not None:
        access.require(actor, "use", owner)
    elif not access.is_superuser(actor):
        raise InvalidInput("Name the project (or team) the model belongs to; only administrators add shared models.",
                           details={"owner": "required"})
