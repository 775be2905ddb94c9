"""A node's recent jobs (``serving.models.NodeJob``), one line each: a fragment the node's page in the
fleet console loads and refreshes. Staff only, as the rest of a node's evidence about every tenant's
models (``scheduler.reach``)."""

from django.contrib.auth.mixins import UserPassesTestMixin
from django.urls import reverse
from django.utils.timesince import timesince

from berth.tables import Column, Table
from scheduler import reach
from scheduler.models import Node
from serving.models import NodeJob
from tenancy.console import ConsolePage

RECENT = 50


def _replica(job: NodeJob) -> str | None:
    if job.replica is None:
        return None
    return f"{job.replica.deployment.name} · {str(job.replica.public_id)[:8]}"


def _state(job: NodeJob) -> str:
    text = job.get_state_display()
    return f"{text}, cancel asked" if job.cancel_requested and job.state == NodeJob.State.LEASED else text


class NodeJobTable(Table):
    columns = (
        Column("Kind", lambda j: j.get_kind_display()),
        Column("Replica", _replica,
               link=lambda j: reverse("serving:deployment", args=[j.replica.deployment.public_id])),
        Column("State", _state),
        Column("Attempts", lambda j: f"{j.attempts} of {j.max_attempts}", sort="attempts"),
        Column("Age", lambda j: timesince(j.created_at), sort=lambda j: -j.created_at.timestamp()),
        Column("Error", "error", sort=False),
    )
    empty_message = "No jobs for this node yet."


class NodeJobsView(UserPassesTestMixin, ConsolePage):
    """GET a node's most recent jobs (``RECENT``), newest first: the same fragment, plain or to HTMX."""

    model = Node
    template_name = "serving/node_jobs.html"
    fragment_template_name = "serving/node_jobs.html"

    def test_func(self):
        return reach.sees_everything(self.request.user)

    def narrow(self, queryset):
        return queryset  # the fleet is not a tenant's: staff see every node

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        node = self.get_object()
        jobs = (NodeJob.objects.filter(node=node).select_related("replica__deployment")
                .order_by("-created_at", "-id")[:RECENT])
        context["node"] = node
        context["table"] = NodeJobTable(jobs)
        return context
