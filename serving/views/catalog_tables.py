from collections import Counter
from urllib.parse import urlencode

from django.template.defaultfilters import filesizeformat
from django.urls import reverse

from berth.tables import Column, Table
from serving.models import DeploymentState as S
from serving.models.states import TERMINAL


def _bytes(entry):
    return sum(f.size or 0 for f in entry.files.all()) or None


def _size(entry):
    total = _bytes(entry)
    return filesizeformat(total) if total else None


def _verified(entry):
    files = list(entry.files.all())
    if not files:
        return None
    if any(f.quarantined for f in files):
        return "quarantined"
    return "verified" if all(f.verified for f in files) else "unverified"


def _replicas(entry):
    where = entry.placement
    text = f"{where['ready']} of {where['wanted']} ready"
    return f"{text}, {where['starting']} starting" if where["starting"] else text


def _deployments(entry):
    """``ready 1/1 · 2 stopped``: each live deployment's state with its ready replicas of those it
    wants, then the ended ones counted by state (the rows ``queries.held`` attached)."""
    live, ended = [], Counter()
    for deployment in entry.deployments:
        if deployment.state in TERMINAL:
            ended[deployment.state] += 1
            continue
        ready = sum(r.state == S.READY for r in deployment.replica_set.all())
        live.append(f"{deployment.state} {ready}/{deployment.replicas}")
    ended_text = [state if count == 1 else f"{count} {state}" for state, count in sorted(ended.items())]
    return " · ".join(live + ended_text) or None


def _deployments_link(entry):
    return f"{reverse('serving:index')}?{urlencode({'q': entry.name})}"


def _nodes(entry):
    return ", ".join(entry.placement["nodes"]) or None


def _state(entry):
    return entry.placement["state"]


def _scaling(entry):
    """``0–2 · opportunistic (automatic) · pinned``: what placement is asked to keep."""
    kind = f"{entry.effective_class} (automatic)" if not entry.service_class else entry.service_class
    return " · ".join([f"{entry.scaling_min}–{entry.scaling_max}", kind] + (["pinned"] if entry.pinned else []))


def deployable(entry):
    """``Deploy`` where the wizard can start from it: a profile, files the mirror verified, and no
    deployment serving its name yet (a second would be refused; placement adds replicas)."""
    serving = any(d.name == entry.name and d.state not in TERMINAL for d in entry.deployments)
    return "Deploy" if entry.profiles and _verified(entry) == "verified" and not serving else None


def _deploy_link(entry):
    return f"{reverse('serving:deploy')}?{urlencode({'model': str(entry.public_id)})}"


class HeldTable(Table):
    columns = (
        Column("Model", "name", link=lambda e: reverse("serving:catalog-card", args=[e.public_id])),
        Column("Task", lambda e: e.get_task_display()),
        Column("Format", lambda e: f"{e.get_format_display()} {e.quantisation}".strip()),
        Column("Size", _size, numeric=True, sort=_bytes),
        Column("Files", _verified),
        Column("Replicas", _replicas),
        Column("Deployments", _deployments, link=_deployments_link),
        Column("Nodes", _nodes),
        Column("State", _state),
        Column("Placement", _scaling),
        Column("Source", lambda e: e.source_repo or e.source_package or e.source_path),
        Column("Owner", lambda e: e.owner.written if e.owner else "shared"),
        Column("Actions", deployable, link=_deploy_link, action="deploy", sort=False),
    )
    empty_message = "The mirror holds no model yet. Fetch one from the hub on the Fetch tab, or serve one in one step there."


class FetchJobTable(Table):
    columns = (
        Column("Repository", "repo", link=lambda j: reverse("serving:catalog-job", args=[j.public_id])),
        Column("Commit", lambda j: j.commit[:8]),
        Column("Status", lambda j: j.get_status_display()),
        Column("Progress", lambda j: f"{j.percent}%" if j.percent is not None else None, numeric=True, sort="percent"),
        Column("Size", lambda j: filesizeformat(j.total_bytes) if j.total_bytes else None, numeric=True, sort="total_bytes"),
        Column("Error", "error"),
    )
    empty_message = "No fetch yet: the Fetch tab downloads a model from the hub into the mirror."


class FileTable(Table):
    columns = (
        Column("File", "repo_path"),
        Column("Size", lambda f: filesizeformat(f.size) if f.size else None, numeric=True, sort="size"),
        Column("SHA-256", lambda f: f.sha256[:16]),
        Column("Verified", lambda f: "quarantined" if f.quarantined else ("yes" if f.verified else "no")),
        Column("Node", lambda f: f.node.name if f.node else "control plane"),
        Column("Held on", lambda f: ", ".join(getattr(f, "held_on", ()))),
    )
