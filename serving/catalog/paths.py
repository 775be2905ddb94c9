"""Where the mirror keeps what it fetched: under the first model root (so deployments may name the
files), one folder per repository and commit; files that fail verification go to the quarantine,
which nothing may deploy (``scheduler.memory.allowed_model_path`` refuses it)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from scheduler.memory import quarantine_root

__all__ = ["local_path", "mirror_root", "quarantine_root"]


def mirror_root() -> Path:
    """Where fetched files live: under the first model root, so deployments may name them."""
    return Path(settings.SCHEDULER_MODEL_ROOTS[0]) / "hub"


def local_path(repo: str, commit: str, path: str) -> Path:
    return mirror_root() / repo / commit / path
