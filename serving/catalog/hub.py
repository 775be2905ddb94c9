"""The Hugging Face hub as the mirror sees it, through ``huggingface_hub``.

The endpoint is ``HF_ENDPOINT`` (read at each call, so a deployment's own hub mirror or a test's
local server is honoured), the token ``HF_TOKEN`` and optional: without one, public repositories
work and gated ones are refused. A network failure is ``HubUnreachable`` — the Explore tab says so
and nothing else in Berth depends on the hub.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import requests
from django.conf import settings
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session

from berth.errors import InvalidInput
from scheduler import memory
from scheduler.errors import UnreadableModel
from scheduler.estimation import gguf_header
from serving.catalog.errors import HubRefused, HubUnreachable, NoMatchingFiles, RepositoryNotFound

DEFAULT_QUANT = "Q4_K_M"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
WEIGHT_SUFFIXES = (".gguf", ".safetensors") + PICKLE_SUFFIXES
_SHARD = re.compile(r"^(?P<stem>.+?)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(r"(?:^|[-_.])(?P<quant>I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32|FP16|FP32)$", re.IGNORECASE)


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or settings.SERVING_HUB_ENDPOINT).rstrip("/")


def token() -> str | bool:
    # False, not None: never fall back to a token someone left in ~/.cache/huggingface.
    return os.environ.get("HF_TOKEN") or settings.SERVING_HUB_TOKEN or False


def api() -> HfApi:
    return HfApi(endpoint=endpoint(), token=token(), library_name="berth")


@dataclasses.dataclass(frozen=True)
class HubFile:
    path: str
    size: int | None
    sha256: str  # the LFS object id; empty for small files kept in git
    blob_id: str = ""  # the git blob id (what a small file is checked against)

    @property
    def is_weights(self) -> bool:
        return self.path.lower().endswith(WEIGHT_SUFFIXES)


@dataclasses.dataclass(frozen=True)
class FileSet:
    """The files served together: one quantisation (its shards together), or a safetensors model."""

    name: str
    quantisation: str
    files: tuple[HubFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size or 0 for f in self.files)

    @property
    def format(self) -> str:
        return "gguf" if self.files[0].path.lower().endswith(".gguf") else "safetensors"


@dataclasses.dataclass(frozen=True)
class Repository:
    repo: str
    commit: str
    gated: bool
    private: bool
    tags: tuple[str, ...]
    pipeline_tag: str
    license: str
    downloads: int | None
    config: dict[str, Any]
    files: tuple[HubFile, ...]

    @property
    def needs_remote_code(self) -> bool:
        return "custom_code" in self.tags or bool((self.config or {}).get("auto_map"))

    @property
    def pickle_only(self) -> bool:
        weights = [f for f in self.files if f.is_weights]
        return bool(weights) and all(f.path.lower().endswith(PICKLE_SUFFIXES) for f in weights)

    def file_sets(self) -> list[FileSet]:
        return file_sets(self.files)


def _hub_call(call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except GatedRepoError:  # a kind of RepositoryNotFoundError: the caller decides what it means
        raise
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        raise RepositoryNotFound(f"The hub has no such repository or revision ({error.__class__.__name__}).",
                                 details={"endpoint": endpoint()}) from None
    except (requests.ConnectionError, requests.Timeout) as error:
        raise HubUnreachable(f"The hub at {endpoint()} is unreachable: {error.__class__.__name__}.",
                             details={"endpoint": endpoint()}) from None
    except HFValidationError as error:  # a repository id or revision the hub could never hold
        raise InvalidInput(f"Not a hub repository (owner/name) or revision: {error}",
                           details={"repo": "owner/name"}) from None
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status is not None and status >= 500:
            raise HubUnreachable(f"The hub at {endpoint()} answered {status}.", details={"endpoint": endpoint()}) from None
        if status == 404:  # no such thing, said without the hub's error header
            raise RepositoryNotFound("The hub has no such repository or revision.",
                                     details={"endpoint": endpoint()}) from None
        raise HubRefused(f"The hub refused the request ({status}).", details={"status": status}) from None


def _license(info) -> str:
    card = getattr(info, "card_data", None)
    if card is not None and getattr(card, "license", None):
        return str(card.license)
    return next((t.split(":", 1)[1] for t in (info.tags or []) if t.startswith("license:")), "")


def search(query: str, limit: int = 20) -> list[dict[str, Any]]:
    """Models matching ``query``: id, downloads, task, license, gated."""
    def run():
        return list(api().list_models(search=query or None, limit=limit, full=True, sort="downloads", cardData=True))

    results = _hub_call(run)
    return [{"repo": m.id, "downloads": m.downloads, "likes": m.likes, "task": m.pipeline_tag or "",
             "license": _license(m), "gated": bool(m.gated), "tags": list(m.tags or [])} for m in results]


def repository(repo: str, revision: str = "main") -> Repository:
    """The repository at ``revision`` resolved to its commit, with every file's size and LFS SHA-256."""
    info = _hub_call(api().model_info, repo, revision=revision, files_metadata=True,
                     timeout=settings.SERVING_HUB_TIMEOUT)
    files = tuple(HubFile(path=s.rfilename, size=(s.lfs.size if s.lfs else s.size),
                          sha256=(s.lfs.sha256 if s.lfs else "") or "", blob_id=s.blob_id or "") for s in (info.siblings or []))
    return Repository(repo=info.id or repo, commit=info.sha or "", gated=bool(info.gated), private=bool(info.private),
                      tags=tuple(info.tags or ()), pipeline_tag=info.pipeline_tag or "", license=_license(info),
                      downloads=info.downloads, config=info.config or {}, files=files)


def has_access(repo: Repository) -> bool:
    """Whether our token may download the repository's files (asked with a HEAD of one file)."""
    if not repo.files:
        return True
    from huggingface_hub import get_hf_file_metadata

    url = file_url(repo.repo, repo.commit, repo.files[0].path)
    try:
        _hub_call(get_hf_file_metadata, url, token=token(), timeout=settings.SERVING_HUB_TIMEOUT)
    except GatedRepoError:
        return False
    return True


def file_url(repo: str, commit: str, path: str) -> str:
    return hf_hub_url(repo, path, revision=commit, endpoint=endpoint())


def quantisation_of(name: str) -> str:
    stem = re.sub(r"\.gguf$", "", name.rsplit("/", 1)[-1], flags=re.IGNORECASE)
    match = _QUANT.search(stem)
    return match.group("quant").upper() if match else ""


def file_sets(files) -> list[FileSet]:
    """GGUF files grouped by quantisation (shards of one file kept together; vision projectors and
    importance matrices left out), and the safetensors files of the repository as one set."""
    groups: dict[str, list[HubFile]] = {}
    for file in files:
        lower = file.path.lower()
        if not lower.endswith(".gguf") or "mmproj" in lower or "imatrix" in lower:
            continue
        shard = _SHARD.match(file.path)
        name = shard.group("stem") if shard else re.sub(r"\.gguf$", "", file.path, flags=re.IGNORECASE)
        groups.setdefault(name, []).append(file)
    sets = [FileSet(name=name, quantisation=quantisation_of(name), files=tuple(sorted(members, key=lambda f: f.path)))
            for name, members in sorted(groups.items())]
    safetensors = tuple(f for f in files if f.path.lower().endswith(".safetensors"))
    if safetensors:
        companions = tuple(f for f in files if f.path.lower().endswith((".json", ".txt", ".model", ".jinja"))
                           and "/" not in f.path)
        sets.append(FileSet(name="safetensors", quantisation="", files=safetensors + companions))
    return sets


def choose_set(files, quant: str | None = None, file: str | None = None) -> FileSet:
    """``file`` names a set or any of its files; otherwise ``quant`` (Q4_K_M by default) as a
    case-insensitive substring of set names, preferring the set with fewest shards."""
    sets = file_sets(files)
    if not sets:
        raise NoMatchingFiles("The repository holds no GGUF or safetensors weights.", details={"sets": []})
    if file:
        for candidate in sets:
            if candidate.name == file or any(f.path == file for f in candidate.files):
                return candidate
        raise NoMatchingFiles(f"No file set or file named {file!r}.", details={"sets": [s.name for s in sets]})
    gguf_sets = [s for s in sets if s.format == "gguf"]
    if not gguf_sets:
        return sets[0]
    wanted = (quant or DEFAULT_QUANT).lower()
    matches = [s for s in gguf_sets if wanted in s.name.lower()]
    if not matches:
        raise NoMatchingFiles(f"No {quant or DEFAULT_QUANT} file in the repository; it has: "
                              f"{', '.join(s.name for s in gguf_sets)}.", details={"sets": [s.name for s in gguf_sets]})
    return min(matches, key=lambda s: (len(s.files), s.name))


# --- the GGUF header over HTTP ---------------------------------------------------------------

def read_remote_header(repo: str, commit: str, path: str, size: int, *, first_chunk: int = 64 * 1024,
                       limit: int = 64 * 1024 * 1024) -> Path:
    """A sparse local stand-in for a remote GGUF file: its header bytes, fetched with range requests
    (doubling until the header parses), at the file's full size. The caller removes it."""
    url = file_url(repo, commit, path)
    headers = build_hf_headers(token=token())
    have = b""
    want = first_chunk
    directory = Path(tempfile.mkdtemp(prefix="berth-header-"))
    probe = directory / "prefix.gguf"
    while True:
        want = min(want, size, limit)
        if want > len(have):
            response = _hub_call(get_session().get, url, timeout=settings.SERVING_HUB_TIMEOUT,
                                 headers={**headers, "Range": f"bytes={len(have)}-{want - 1}"})
            if response.status_code != 206:
                raise HubUnreachable(f"The hub did not answer a range request for {path} ({response.status_code}).")
            have += response.content
        probe.write_bytes(have)
        try:
            gguf_header.read_metadata(probe)
            break
        except UnreadableModel:
            if want >= size or want >= limit:
                raise
            want *= 2
    stand_in = directory / Path(path).name
    with open(stand_in, "wb") as handle:
        handle.write(have)
        handle.truncate(size)  # sparse: the weights are never fetched, the shape sees the true size
    probe.unlink()
    return stand_in


def remote_estimate(repo: str, commit: str, file: HubFile, context: int = 4096) -> dict[str, Any]:
    """The memory estimate (with its breakdown) of a GGUF file on the hub, from its header alone."""
    import shutil

    stand_in = read_remote_header(repo, commit, file.path, file.size or 0)
    try:
        result = memory.estimate_and_fit(stand_in, "llamacpp", {"ctx_size": context}, check_root=False)
        return {"architecture": result.shape.architecture, "estimate": result.estimate.as_dict(),
                "total_bytes": result.estimate.total_bytes, "context": context}
    finally:
        shutil.rmtree(stand_in.parent, ignore_errors=True)
