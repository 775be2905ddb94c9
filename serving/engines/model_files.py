"""Is a model reference a usable file under an allowed root?

An engine reads whatever path it is given with the agent's privileges, so a deployment may name
only files under the directories an operator allowed (``BERTH_MODEL_ROOTS``), and a symbolic link
inside a root may not lead out of it. The file must be whole: a GGUF starts with its magic bytes
and a split GGUF has every part.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Iterable

from serving.errors import ModelNotAllowed

GGUF_MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def allowed_roots() -> list[Path]:
    from django.conf import settings

    return list(settings.SCHEDULER_MODEL_ROOTS)  # one list of model directories for the estimate and the engines


def _refuse(reason: str, message: str, path: str, roots: list[Path], **extra) -> ModelNotAllowed:
    return ModelNotAllowed(message, details={"reason": reason, "path": path,
                                             "roots": [str(r) for r in roots], **extra})


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def validate_model_path(path: str | os.PathLike, roots: Iterable[str | os.PathLike] | None = None,
                        *, kind: str = "gguf") -> Path:
    """The model's resolved path, or ModelNotAllowed whose ``details["reason"]`` is one of
    ``not_absolute``, ``outside_roots``, ``missing``, ``symlink_escape``, ``not_a_file``,
    ``not_gguf``, ``incomplete`` (a split GGUF missing parts), ``not_a_model_directory``.

    ``kind`` is ``"gguf"`` (llama.cpp: one GGUF file, or the first part of a split one) or
    ``"any"`` (vLLM: a GGUF file or a directory holding ``config.json`` and weights).
    """
    raw = str(path)
    root_list = [Path(r) for r in (allowed_roots() if roots is None else roots)]
    if not os.path.isabs(raw):
        raise _refuse("not_absolute", f"The model path {raw!r} must be absolute.", raw, root_list)
    lexical = Path(os.path.normpath(raw))  # ".." folded, links not followed yet
    # Compare with each root both as written and as resolved (a root may itself be a link, e.g. /tmp).
    matching = [root for root in root_list
                if _under(lexical, Path(os.path.normpath(root))) or _under(lexical, Path(root).resolve())]
    if not matching:
        raise _refuse("outside_roots", f"{raw} is not under an allowed model directory "
                                       f"({', '.join(map(str, root_list)) or 'none configured'}).", raw, root_list)
    if not os.path.lexists(lexical):
        raise _refuse("missing", f"{raw} does not exist.", raw, root_list)
    try:
        resolved = lexical.resolve(strict=True)
    except (OSError, RuntimeError):
        raise _refuse("missing", f"{raw} is a link to something that does not exist.", raw, root_list) from None
    if not any(_under(resolved, root.resolve()) for root in root_list):
        raise _refuse("symlink_escape", f"{raw} is a link that leads out of its model directory (to {resolved}).",
                      raw, root_list, target=str(resolved))
    if resolved.is_dir():
        if kind == "gguf":
            raise _refuse("not_a_file", f"{raw} is a directory; llama.cpp needs a .gguf file.", raw, root_list)
        return _model_directory(resolved, raw, root_list)
    if not resolved.is_file():
        raise _refuse("not_a_file", f"{raw} is not a regular file.", raw, root_list)
    _gguf(resolved, raw, root_list)
    return resolved


def _gguf(resolved: Path, raw: str, roots: list[Path]) -> None:
    try:
        with open(resolved, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise _refuse("missing", f"{raw} cannot be read: {exc.strerror}.", raw, roots) from exc
    if magic != GGUF_MAGIC:
        raise _refuse("not_gguf", f"{raw} is not a GGUF model file (it does not start with the GGUF magic bytes).",
                      raw, roots)
    split = _SPLIT.match(resolved.name)
    if split:
        count = int(split.group("count"))
        missing = [f"{split.group('stem')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)
                   if not (resolved.parent / f"{split.group('stem')}-{i:05d}-of-{count:05d}.gguf").is_file()]
        if missing:
            raise _refuse("incomplete", f"{raw} is part of a split model whose parts {', '.join(missing)} are missing.",
                          raw, roots, missing=missing)


def _model_directory(resolved: Path, raw: str, roots: list[Path]) -> Path:
    names = {p.name for p in resolved.iterdir()}
    weights = [n for n in names if n.endswith((".safetensors", ".bin", ".pt"))]
    unfinished = [n for n in names if n.endswith((".incomplete", ".part", ".lock"))]
    if "config.json" not in names or not weights:
        raise _refuse("not_a_model_directory", f"{raw} holds no config.json and weights.", raw, roots)
    if unfinished:
        raise _refuse("incomplete", f"{raw} is still being downloaded ({', '.join(sorted(unfinished))}).",
                      raw, roots, unfinished=sorted(unfinished))
    return resolved


def file_sha256(path: Path) -> str:
    """A file's SHA-256, read a MiB at a time (the mirror's files run to tens of GiB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
