"""The mirror's weights to a node that does not hold them: which files a replica's node fetches and
where they go, the signed link it fetches each through, and the control plane's answer to it (a
byte range, so a broken transfer resumes where it stopped). The node's half — fetching, checking
SHA-256 against the catalog, quarantining a mismatch — is ``serving.node.weights``.

A node holds a model when it reported the catalog's own path among its weights (it shares the
control plane's disk, or the same machine), or when it already fetched a verified copy; a node that
reports no model directory at all is taken to share the control plane's files, as before nodes
fetched. Otherwise the files go under its first model directory, at the path they have under the
control plane's model root (``hub/<repo>/<revision>/<file>`` for the mirror's).

The link is signed with the control plane's secret (``django.core.signing``) and names one file and
one node; it expires after ``SERVING_WEIGHTS_LINK_SECONDS``. A node agent holds that secret today;
when nodes get credentials of their own ("node trust"), only ``link_for`` and ``node_of`` change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from django.conf import settings
from django.core import signing

from berth.errors import NotFound, PermissionDenied
from scheduler.models import HeldWeight, Node
from serving.models import ModelEntry, ModelFile

SALT = "berth.weights-link"
CHUNK = 1024 * 1024


def files_of(entry: ModelEntry, path: Path) -> list[ModelFile]:
    """The control plane's verified files behind ``path`` (a file, or a model folder's files)."""
    found = ModelFile.objects.filter(model=entry, node__isnull=True, verified=True, quarantined=False)
    return [f for f in found.order_by("path") if Path(f.path) == path or path in Path(f.path).parents]


def _relative(path: Path) -> Path | None:
    for root in settings.SCHEDULER_MODEL_ROOTS:
        root = Path(root)
        if path == root or root in path.parents:
            return path.relative_to(root)
    return None


def _held(node: Node, paths: list[str]) -> bool:
    reported = {str(Path(directory) / weight) for directory, weight in
                HeldWeight.objects.filter(directory__node=node).values_list("directory__path", "path")}
    return all(path in reported for path in paths)


def plan(entry: ModelEntry, node: Node, path: Path) -> tuple[str, list[dict]]:
    """(where the engine finds ``path`` on ``node``: "" for the path itself, and the files the node
    fetches first: [{file, to, size, sha256}], empty when it holds them)."""
    files = files_of(entry, path)
    directories = list(node.model_directories.order_by("path").values_list("path", flat=True))
    relative = _relative(path)
    if not files or not directories or relative is None or _held(node, [f.path for f in files]):
        return "", []
    root = Path(directories[0])
    moved = []
    for file in files:
        to = root / _relative(Path(file.path))
        copy = ModelFile.objects.filter(node=node, path=str(to), verified=True, quarantined=False).first()
        if copy is None or copy.sha256 != (file.expected_sha256 or file.sha256):
            moved.append({"file": str(file.public_id), "to": str(to), "size": file.size,
                          "sha256": file.expected_sha256 or file.sha256, "repo_path": file.repo_path})
    return str(root / relative), moved


# --- the signed link and the control plane's answer ---------------------------------------------------

def link_for(file_id: str, node: Node) -> str:
    """A token that lets ``node`` fetch one file of the mirror, for ``SERVING_WEIGHTS_LINK_SECONDS``."""
    return signing.dumps({"file": file_id, "node": str(node.public_id)}, salt=SALT)


def node_of(token: str, file_id: str) -> Node:
    """The node a link was made for, when it is genuine, unexpired and for this file; 403 otherwise."""
    try:
        data = signing.loads(token, salt=SALT, max_age=settings.SERVING_WEIGHTS_LINK_SECONDS)
    except signing.SignatureExpired:
        raise PermissionDenied("This weights link has expired: the node asks for a new one.") from None
    except signing.BadSignature:
        raise PermissionDenied("This is not a weights link Berth made.") from None
    node = Node.objects.filter(public_id=data.get("node")).first()
    if data.get("file") != str(file_id) or node is None:
        raise PermissionDenied("This weights link is for another file or a node that is gone.")
    return node


def servable(file_id) -> ModelFile:
    """A file of the mirror a node may fetch: the control plane's own, verified, not quarantined."""
    file = ModelFile.objects.filter(public_id=file_id, node__isnull=True, verified=True, quarantined=False).first()
    if file is None or not Path(file.path).is_file():
        raise NotFound("No such verified file in the mirror.")
    return file


def read_from(path: Path, start: int) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        handle.seek(start)
        while chunk := handle.read(CHUNK):
            yield chunk
