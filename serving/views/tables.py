from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django.utils.timesince import timesince

from berth.tables import Column, Table
from serving.deployments import gate


def _state(deployment):
    replicas = list(deployment.replica_set.all())
    queued = [gate.position(r) for r in replicas if r.state == "queued"]
    text = deployment.get_state_display()
    return f"{text} (#{queued[0]} in line)" if queued and queued[0] else text


def _bytes(value):
    return None if not value else filesizeformat(value)


def _peak(deployment):
    return max((r.peak_memory_bytes for r in deployment.replica_set.all() if r.peak_memory_bytes), default=None)


def _measured(deployment):
    return _bytes(_peak(deployment))


class DeploymentTable(Table):
    columns = (
        Column("Model", "name", link=lambda d: reverse("serving:deployment", args=[d.public_id])),
        Column("Engine", lambda d: d.get_engine_display()),
        Column("Runtime", lambda d: d.get_runtime_display()),
        Column("Node", "node.name"),
        Column("GPU", lambda d: ", ".join(d.gpu_uuids)),
        Column("State", _state),
        Column("Reserved", lambda d: _bytes(d.memory_reserved_bytes), numeric=True, sort="memory_reserved_bytes"),
        Column("Measured", _measured, numeric=True, sort=_peak),
        Column("Owner", lambda d: d.owner.written if d.owner else None),
        Column("Age", lambda d: timesince(d.created_at), sort=lambda d: -d.created_at.timestamp()),
    )
    empty_message = "No deployments yet: deploy a model the mirror holds from Models → Catalog (its Deploy link), or with Deploy a model above."


class EventTable(Table):
    columns = (
        Column("When", lambda e: e.at.strftime("%Y-%m-%d %H:%M:%S")),
        Column("From", "from_state"),
        Column("To", "to_state"),
        Column("What happened", "message"),
    )


class OperationTable(Table):
    columns = (
        Column("When", lambda o: o.created_at.strftime("%Y-%m-%d %H:%M:%S")),
        Column("What", lambda o: o.get_kind_display()),
        Column("State", lambda o: o.get_state_display()),
        Column("Steps", lambda o: " → ".join(f"{s['step']} ({s['status']})" for s in o.steps)),
        Column("Outcome", "message"),
    )
    empty_message = "No switch or reconfiguration yet."
