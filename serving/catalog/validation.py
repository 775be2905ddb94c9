"""A catalog entry checked whole: every problem listed at once; its fingerprint."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from scheduler import labels
from serving.catalog import profiles as catalog_profiles
from serving.catalog.errors import InvalidModelEntry
from serving.models import ModelEntry

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
CLASS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # as discovery names them: h100-80g, a100-80g-mig-3g.40gb
ENGINES = ("llamacpp", "vllm")
TASKS = ("chat", "completion", "embedding", "rerank")
CLASSES = ("", "critical", "standard", "opportunistic")  # "": automatic (the placement policy's rule)
FORMATS = ("gguf", "safetensors")
MAX_OUTPUT_TOKENS = 2**31 - 1  # what the engines take (llama.cpp's n_predict is an int32)


def problems_of(entry: dict[str, Any]) -> list[dict[str, str]]:
    """Every problem with ``entry`` (the fields of ModelEntry as a dict), none when it is whole."""
    found: list[dict[str, str]] = []

    def problem(field: str, message: str) -> None:
        found.append({"field": field, "message": message})

    name = entry.get("name") or ""
    if not NAME.match(name):
        problem("name", "1-200 letters, digits and . _ : / - (no spaces): the name clients ask for.")
    aliases = entry.get("aliases") or []
    if not isinstance(aliases, list) or any(not isinstance(a, str) or not NAME.match(a) for a in aliases):
        problem("aliases", "A list of names, each like a model name.")
    elif name in aliases or len(set(aliases)) != len(aliases):
        problem("aliases", "An alias repeats the name or another alias.")
    if entry.get("task") not in TASKS:
        problem("task", f"One of {', '.join(TASKS)}.")
    if entry.get("format") not in FORMATS:
        problem("format", f"One of {', '.join(FORMATS)}.")
    kind = entry.get("source_kind")
    if kind == "hub":
        if not REPO.match(entry.get("source_repo") or ""):
            problem("source_repo", "A hub repository looks like owner/name.")
        if not re.fullmatch(r"[0-9a-f]{40}", entry.get("source_revision") or ""):
            problem("source_revision", "A hub source is pinned to a commit (40 hex digits), not a branch.")
    elif kind == "local":
        if not entry.get("source_path"):
            problem("source_path", "A local source names its path.")
    elif kind == "package":
        if not entry.get("source_package"):
            problem("source_package", "A package source names its package.")
    else:
        problem("source_kind", "One of hub, local, package.")
    profiles = entry.get("profiles") or []
    if not profiles:
        problem("profiles", "At least one profile (engine, file, context).")
    names = set()
    for index, profile in enumerate(profiles):
        where = f"profiles[{index}]"
        if not isinstance(profile, dict):
            problem(where, "A profile is an object.")
            continue
        if not isinstance(profile.get("name"), str) or not profile["name"].strip():
            problem(f"{where}.name", "A profile has a name: placement and its measured speed refer to it.")
        elif profile.get("name") in names:
            problem(f"{where}.name", "Two profiles share a name.")
        names.add(profile.get("name"))
        engine = profile.get("engine")
        if engine not in ENGINES:
            problem(f"{where}.engine", f"One of {', '.join(ENGINES)}.")
        if engine == "llamacpp" and entry.get("format") == "safetensors":
            problem(f"{where}.engine", "llama.cpp serves GGUF files, not safetensors.")
        if engine == "llamacpp" and not profile.get("file"):
            problem(f"{where}.file", "A llama.cpp profile names the GGUF file it serves.")
        for key in ("context", "parallel", "cores"):
            value = profile.get(key)
            if value is not None and (not isinstance(value, int) or value < 1):
                problem(f"{where}.{key}", "A whole number, at least 1.")
        priority = profile.get("priority")
        if priority is not None and (not isinstance(priority, int) or not 0 <= priority <= 100):
            problem(f"{where}.priority", "0 to 100.")
        found.extend(placement_problems(profile, where))
    low, high = entry.get("scaling_min", 0), entry.get("scaling_max", 1)
    if not _whole(low) or low < 0:
        problem("scaling_min", f"A whole number, 0 or more (not {low!r}).")
    if not _whole(high) or high < 0:
        problem("scaling_max", f"A whole number, 0 or more (not {high!r}).")
    elif _whole(low) and high < low:
        problem("scaling_max", f"At least the minimum ({low}), not {high}.")
    timeout = entry.get("idle_timeout_seconds")
    if timeout is not None and (not _whole(timeout) or timeout < 1):

        problem("idle_timeout_seconds", f"Seconds, at least 1 (not {timeout!r}), or empty for the default "
                                        f"({ModelEntry.DEFAULT_IDLE_SECONDS} s).")
    cap = entry.get("max_output_tokens")
    if cap is not None and (not _whole(cap) or not 1 <= cap <= MAX_OUTPUT_TOKENS):
        problem("max_output_tokens", f"A whole number of tokens, 1 to {MAX_OUTPUT_TOKENS} (not {cap!r}), or empty "
                                     f"for no cap of its own.")
    service_class = entry.get("service_class")
    if service_class not in CLASSES:
        named = ", ".join(c for c in CLASSES if c)
        problem("service_class", f"One of {named}, or empty for automatic (not {service_class!r}).")
    if not isinstance(entry.get("pinned", False), bool):
        problem("pinned", f"True or false (not {entry.get('pinned')!r}).")
    draft = entry.get("draft") or ""
    if not isinstance(draft, str) or (draft and not NAME.fullmatch(draft)):
        problem("draft", "A model name, or empty for none.")
    elif draft and draft == name:
        problem("draft", "A model cannot draft for itself.")
    fallbacks = entry.get("fallbacks") or []
    if not isinstance(fallbacks, list) or any(not isinstance(f, str) or not NAME.fullmatch(f) for f in fallbacks):
        problem("fallbacks", "A list of model names.")
    elif name in fallbacks:
        problem("fallbacks", "A model cannot fall back to itself.")
    return found


def placement_problems(profile: dict[str, Any], where: str) -> list[dict[str, str]]:
    """What is wrong with a profile's placement constraints (``profiles.PLACEMENT_KEYS``); each
    problem names its field and carries a stable ``code``."""
    found = []

    def problem(key: str, code: str, message: str) -> None:
        found.append({"field": f"{where}.{key}", "code": code, "message": message})

    wanted = profile.get("accelerator_class")
    if wanted is not None and wanted != "":
        listed = [wanted] if isinstance(wanted, str) else wanted
        if not isinstance(listed, list) or not listed or any(not isinstance(c, str) or not CLASS.match(c)
                                                             for c in listed):
            problem("accelerator_class", "invalid_accelerator_class",
                    "An accelerator class (letters, digits, '.', '_', '-', e.g. h100 or h100-80g) or a "
                    f"non-empty list of them (not {wanted!r}).")
        elif len({c.lower() for c in listed}) != len(listed):
            problem("accelerator_class", "invalid_accelerator_class", "A class is listed twice.")
        elif _on_cpu(profile):
            problem("accelerator_class", "invalid_accelerator_class",
                    "An accelerator class asks for a GPU: the profile runs on the CPU (gpus 0).")
    selector = profile.get("node_selector")
    if selector is not None:
        wrong = labels.problems(selector)
        if wrong:
            problem("node_selector", "invalid_node_selector", " ".join(wrong))
    size = profile.get("min_disk")
    if size is not None:
        try:
            catalog_profiles.size_bytes(size)
        except ValueError:
            problem("min_disk", "invalid_min_disk",
                    f"Bytes (a whole number, 0 or more) or a size such as \"40 GiB\" or \"500 MB\" (not {size!r}).")
    mig = profile.get("mig")
    if mig is not None and not isinstance(mig, bool):
        problem("mig", "invalid_mig", f"True or false: whether MIG instances may run it (not {mig!r}).")
    return found


def _on_cpu(profile: dict[str, Any]) -> bool:
    try:
        return not catalog_profiles.gpus(profile)
    except (TypeError, ValueError):
        return False  # an unreadable GPU count is not this field's problem


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_valid(entry: dict[str, Any]) -> None:
    found = problems_of(entry)
    if found:
        listed = "; ".join(f"{p['field']}: {p['message']}" for p in found)
        raise InvalidModelEntry(f"The model entry is incomplete or contradictory — {listed}",
                                details={"problems": found})


def fingerprint(entry: dict[str, Any]) -> str:
    """First 8 bytes (hex) of SHA-256 over the source, profiles and draft: what identifies a definition."""
    keys = ("source_kind", "source_repo", "source_revision", "source_path", "source_package", "format", "profiles")
    # The draft runs in the same engine: a part of the definition (counted only when set, so entries
    # without one keep the fingerprints they had).
    canonical = json.dumps({k: entry.get(k) for k in keys} | ({"draft": entry["draft"]} if entry.get("draft") else {}),
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
