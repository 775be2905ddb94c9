from django.template.defaultfilters import filesizeformat
from django.utils.timesince import timesince

from berth.tables import Column, Table


def _engines(node):
    return ", ".join(f"{e.get_kind_display()} {e.version}" for e in node.engines.all())


def _bytes(field):
    def read(node):
        value = getattr(node, field)
        return None if value is None else filesizeformat(value)
    return read


def _heartbeat(node):
    return None if node.last_heartbeat_at is None else f"{timesince(node.last_heartbeat_at)} ago"


class NodeTable(Table):
    columns = (
        Column("Name", "name"),
        Column("State", lambda n: n.get_state_display()),
        Column("Address", "address"),
        Column("CPUs", "cpu_count", numeric=True),
        Column("Memory", _bytes("memory_total_bytes"), numeric=True),
        Column("Available", _bytes("memory_available_bytes"), numeric=True),
        Column("Engines", _engines),
        Column("Agent", "agent_version"),
        Column("Last heartbeat", _heartbeat),
    )
    empty_message = "No nodes yet: `make up` registers this machine; other machines join with the agent."
