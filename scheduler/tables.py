from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django.utils.timesince import timesince

from berth.tables import Column, Table


def _engines(node):
    return ", ".join(f"{e.get_kind_display()} {e.version}" for e in node.engines.all())


def _gpus(node):
    cards = [a for a in node.accelerators.all() if a.parent_id is None]
    if not cards:
        return None
    classes = sorted({a.accelerator_class for a in cards})
    return f"{len(cards)}× {', '.join(classes)}"


def _bytes(field):
    def read(node):
        value = getattr(node, field)
        return None if value is None else filesizeformat(value)
    return read


def _heartbeat(node):
    return None if node.last_heartbeat_at is None else f"{timesince(node.last_heartbeat_at)} ago"


class NodeTable(Table):
    columns = (
        Column("Name", "name", link=lambda n: reverse("scheduler:node", kwargs={"public_id": n.public_id})),
        Column("State", lambda n: n.get_state_display()),
        Column("Address", "address"),
        Column("CPUs", "cpu_count", numeric=True),
        Column("Memory", _bytes("memory_total_bytes"), numeric=True, sort="memory_total_bytes"),
        Column("Available", _bytes("memory_available_bytes"), numeric=True, sort="memory_available_bytes"),
        Column("GPUs", _gpus),
        Column("Engines", _engines),
        Column("Agent", "agent_version"),
        Column("Last heartbeat", _heartbeat),
    )
    empty_message = "No nodes yet: `make up` registers this machine; other machines join with the agent."


def _gib(value):
    return f"{value / 2**30:,.1f}"


def memory_bar(accelerator) -> dict:
    """Used (measured), reserved (by Berth: ``reserved_bytes``, as the fleet views annotate it) and
    free on one bar; unknown stays unknown."""
    total, used, reserved = accelerator.memory_total_bytes, accelerator.memory_used_bytes, accelerator.reserved_bytes
    if not total:
        return {"known": False}
    return {"known": True, "used_known": used is not None,
            "used_pct": 0 if used is None else round(min(100, used * 100 / total), 1),
            "reserved_pct": round(min(100, reserved * 100 / total), 1),
            "used": None if used is None else _gib(used), "reserved": _gib(reserved), "total": _gib(total),
            "free": _gib(max(0, total - max(used or 0, reserved)))}


def _telemetry(a):
    parts = []
    if a.utilisation_percent is not None:
        parts.append(f"{a.utilisation_percent:.0f}%")
    if a.temperature_c is not None:
        parts.append(f"{a.temperature_c:.0f} °C")
    if a.power_watts is not None:
        limit = f" / {a.power_limit_watts:.0f}" if a.power_limit_watts is not None else ""
        parts.append(f"{a.power_watts:.0f}{limit} W")
    return " · ".join(parts) or None


def _throttle(a):
    if a.throttle_reasons is None:
        return None
    return ", ".join(r for r in a.throttle_reasons if r != "gpu_idle") or "none"


class AcceleratorTable(Table):
    columns = (
        Column("Node", "node.name", link=lambda a: reverse("scheduler:node", kwargs={"public_id": a.node.public_id})),
        Column("GPU", lambda a: f"{a.index}" if a.mig_index is None else f"{a.index}/{a.mig_index}", numeric=True),
        Column("Class", "accelerator_class"),
        Column("Memory (GiB)", lambda a: None if a.memory_total_bytes is None else
               f"{'—' if a.memory_used_bytes is None else _gib(a.memory_used_bytes)} / {_gib(a.memory_total_bytes)}",
               numeric=True),
        Column("Telemetry", _telemetry),
        Column("Throttle", _throttle),
        Column("Health", lambda a: None if a.healthy is None else ("healthy" if a.healthy else "unhealthy")),
        Column("Placement", lambda a: "placeable" if a.placeable else a.unplaceable_reason),
        Column("UUID", "uuid"),
    )
    empty_message = "No GPUs: a node's agent reports the GPUs it finds (NVML) when it starts and with every heartbeat."

    def with_bars(self):
        return [(memory_bar(row), line) for row, line in zip(self.rows, self.lines)]


def _ago(value):
    return None if value is None else f"{timesince(value)} ago"


_LEVELS = {0: "full", 1: "degraded", 2: "minimal"}


class ParkedModelTable(Table):
    """Parked models (``recovery_service.parked``'s dicts), one line each with why; the template
    adds a Retry button to the rows that have failure memory to reset, for staff."""

    columns = (
        Column("Model", "model"),
        Column("Failure", lambda p: {"crash": "crash", "oom": "out of memory", "hang": "hang"}.get(p["kind"])),
        Column("In a row", "consecutive", numeric=True),
        Column("Level", lambda p: _LEVELS.get(p["level"]) if p["level"] else None),
        Column("Why", "detail"),
        Column("Parked", lambda p: _ago(p["since"]), sort=lambda p: p["since"]),
        Column("Last retried", lambda p: f"{_ago(p['retried_at'])} by {p['retried_by']}" if p["retried_at"] else None),
    )
    empty_message = "No parked model."

    def with_rows(self):
        return list(zip(self.rows, self.lines))


class UnplaceableModelTable(Table):
    columns = (
        Column("Model", "model"),
        Column("Why", "detail"),
        Column("Reasons", lambda u: ", ".join(u["reason_codes"])),
        Column("Decided", lambda u: _ago(u["created_at"]), sort=lambda u: u["created_at"]),
    )
    empty_message = "Every model fits."
