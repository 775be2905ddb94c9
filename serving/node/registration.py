"""The serving app's verbs: views, API, commands and tasks call these."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from scheduler.models import Node
from scheduler.services import register_node
from serving.engines import build_llamacpp
from serving.errors import EngineBuildFailed, UnknownEngine
from serving.node.discovery import local_node_report

BUILDABLE_ENGINES = ("llamacpp",)


def register_local_node() -> Node:
    """Register (or refresh) this machine as a node, with the engines it has."""
    return register_node(local_node_report())


def build_engine(kind: str, *, force: bool = False, jobs: int | None = None, progress=None):
    """Build (or reuse) an engine on this machine, then refresh this node's engines if registered."""
    if kind not in BUILDABLE_ENGINES:
        raise UnknownEngine(f"No engine {kind!r} can be built here; buildable: {', '.join(BUILDABLE_ENGINES)}.",
                            details={"buildable": list(BUILDABLE_ENGINES)})
    try:
        engine = build_llamacpp.build(Path(settings.ENGINE_CACHE_DIR), jobs=jobs, progress=progress, force=force)
    except build_llamacpp.BuildError as exc:
        raise EngineBuildFailed(str(exc), details={"step": exc.step, "log": str(exc.log_path or "")}) from exc
    report = local_node_report()
    if Node.objects.filter(name=report.name).exists():
        register_node(report)
    return engine
