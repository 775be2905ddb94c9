"""The engines this machine has, as the node reports them to the scheduler (in the report's own words:
the agent reads no table; the control plane checks the kinds and states against ``NodeEngine``'s)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from scheduler.reports import EngineReport
from serving.engines import build_llamacpp


def llama_server_path() -> Path | None:
    """The cached llama-server binary, if one has been built."""
    path = build_llamacpp.binary_path(Path(settings.ENGINE_CACHE_DIR))
    return path if path.is_file() else None


def local_engines() -> list[EngineReport]:
    reports = []
    llamacpp = build_llamacpp.installed(Path(settings.ENGINE_CACHE_DIR))
    if llamacpp:
        reports.append(EngineReport(kind="llamacpp", version=llamacpp.version,
                                    source=llamacpp.source, path=str(llamacpp.path)))
    elif llama_server_path():
        reports.append(EngineReport(kind="llamacpp", version="unknown",
                                    path=str(llama_server_path()), state="broken",
                                    detail="The cached llama-server does not run; rebuild it with "
                                           "`manage.py engines build llamacpp --force`."))
    return reports
