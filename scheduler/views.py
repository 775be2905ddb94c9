"""The fleet console: nodes and accelerators, a node's telemetry and actions, estimates, placement.

Views are declarations over the console's bases (``tenancy.console``); who sees what of the fleet is
``scheduler.reach``'s to say.
"""

from typing import Callable
from urllib.parse import urlsplit

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin, UserPassesTestMixin
from django.db.models import OuterRef, Prefetch, Subquery, Sum
from django.db.models.functions import Coalesce
from django.http import QueryDict
from django.shortcuts import render
from django.urls import reverse
from django.utils.cache import add_never_cache_headers
from django.views import View

from berth.errors import BerthError, PermissionDenied
from berth.htmx import render_page
from scheduler import enrolment, memory, placement_service, reach, recovery_service, services
from scheduler.filtersets import NodeFilterSet, PlacementDecisionFilterSet
from scheduler.forms import EnrolForm, EstimateForm, NodeActionForm, NodeLabelsForm
from scheduler.models import (Accelerator, AcceleratorSample, MemoryReservation, ModelDirectory, Node, NodeSample,
                              PlacementDecision)
from scheduler.presenting import estimate_payload
from scheduler.tables import AcceleratorTable, NodeTable, ParkedModelTable, UnplaceableModelTable
from tenancy.audit import Actor
from tenancy.console import ConsolePage, ObjectAction, first_error, filtered


def _accelerators():
    """Accelerators with their node and ``reserved_bytes``, what Berth reserves on each: summed in the
    query, since a prefetch builds a queryset per card (36 ms against 10 for 200 GPUs, bench_console)."""
    reserved = (MemoryReservation.objects.filter(accelerator=OuterRef("pk")).order_by().values("accelerator")
                .annotate(total=Sum("bytes")).values("total"))
    return Accelerator.objects.select_related("node").annotate(
        reserved_bytes=Coalesce(Subquery(reserved), 0)).order_by("node__name", "index", "mig_index")


class StaffOnly(UserPassesTestMixin):
    """Fleet changes and reading files by path: staff only until tenancy's permissions cover the fleet."""

    def test_func(self):
        return reach.sees_everything(self.request.user)


class FleetMixin:
    """Nodes, not narrowed: the fleet's capacity is everyone's to read (``scheduler.reach``)."""

    model = Node

    def narrow(self, queryset):
        return queryset


class FleetView(FleetMixin, ConsolePage):
    """The fleet's nodes and accelerators; the tables refresh themselves through the same URL's fragment."""

    queryset = Node.objects.prefetch_related("engines", Prefetch("accelerators", queryset=Accelerator.objects.all()))
    template_name = "scheduler/fleet.html"
    fragment_template_name = "scheduler/fleet_table.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        filterset = NodeFilterSet(self.request.GET, queryset=self.get_queryset())
        nodes = filtered(filterset)
        context["filterset"] = filterset
        context["table"] = NodeTable(nodes)
        context["accelerators"] = AcceleratorTable(_accelerators().filter(node__in=nodes),
                                                   empty_message="No GPUs reported by these nodes.")
        context["can_estimate"] = reach.sees_everything(self.request.user)
        context["can_enrol"] = context["can_estimate"]
        return context


# What an app above the fleet adds to a node's page for staff: (title, the URL of a fragment for a node),
# loaded with the page (Serving's: the node's recent jobs). The fleet names no app above it.
NODE_SECTIONS: list[tuple[str, Callable[[Node], str]]] = []


def register_node_section(title: str, url_of: Callable[[Node], str]) -> None:
    NODE_SECTIONS.append((title, url_of))


class NodeDetailView(FleetMixin, ConsolePage):
    """A node's capacity and telemetry; what its model directories hold is shown to staff only."""

    template_name = "scheduler/node.html"
    fragment_template_name = "scheduler/node_live.html"

    def get_queryset(self):
        nodes = super().get_queryset().prefetch_related("engines")
        if reach.sees_everything(self.request.user):
            nodes = nodes.prefetch_related(
                Prefetch("model_directories", queryset=ModelDirectory.objects.prefetch_related("weights")))
        return nodes

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        sees_files = reach.sees_everything(self.request.user)
        node = self.get_object()
        context["node"] = node
        context["sees_files"] = sees_files
        context["accelerators"] = AcceleratorTable(_accelerators().filter(node=node),
                                                   empty_message=node.gpu_note or "No GPUs reported.")
        context["node_samples"] = NodeSample.objects.filter(node=node)[:20]
        context["gpu_samples"] = (AcceleratorSample.objects.filter(accelerator__node=node)
                                  .select_related("accelerator")[:40])
        context["can_act"] = reach.sees_everything(self.request.user)
        if sees_files:  # the moves name every tenant's models: staff only, as the files
            context["moves"] = placement_service.moves(node=node.name)
            context["sections"] = [(title, url_of(node)) for title, url_of in NODE_SECTIONS]
        context["labels_text"] = "\n".join(f"{k}={v}" for k, v in sorted((node.labels or {}).items()))
        context["actions"] = [verb for verb, (allowed, _) in services._TRANSITIONS.items() if node.state in allowed]
        context["breadcrumbs"] = [(node.name, self.request.path)]  # after Fleet › Nodes (the navigation's)
        return context


class NodeActionView(StaffOnly, FleetMixin, ObjectAction):
    """POST cordon / uncordon / drain, with an optional reason; back to the node's page, which says
    how it went."""

    form_class = NodeActionForm
    verbs = {"cordon": services.cordon, "uncordon": services.uncordon, "drain": services.drain}

    def perform(self, node, data):
        verb = self.verbs.get(self.kwargs["verb"])
        if verb is None:  # not an action: back to the node
            return node
        node = verb(node, self.actor, reason=data["reason"])
        messages.success(self.request, f"{node.name} is {node.get_state_display().lower()}.")
        return node

    def success_url(self, node, result):
        return reverse("scheduler:node", kwargs={"public_id": node.public_id})


class NodeRevokeView(StaffOnly, FleetMixin, ObjectAction):
    """POST: revoke the node's credential (staff only): the node API refuses it from the next request."""

    def perform(self, node, data):
        node = enrolment.revoke(self.actor, node)
        messages.success(self.request, f"{node.name}'s credential is revoked: its agent is refused from now on. "
                                       f"Enrol it again with a token issued for it.")
        return node

    def success_url(self, node, result):
        return reverse("scheduler:node", kwargs={"public_id": node.public_id})


class EnrolView(LoginRequiredMixin, StaffOnly, View):
    """Enrol a node (staff only): the form, and in the answer to its post the token, shown this once,
    with the agent's command line. Nothing shows it again: the page is not cached, and no list has it."""

    template_name = "scheduler/enrol.html"

    def get(self, request):
        initial = {"existing": request.GET.get("existing")} if request.GET.get("existing") else None
        return self._page(EnrolForm(initial=initial))

    def post(self, request):
        form = EnrolForm(request.POST)
        if not form.is_valid():
            return self._page(form, error=first_error(form), status=400)
        data = form.cleaned_data
        try:
            token, plaintext = enrolment.issue_token(Actor.from_request(request), name=data["name"],
                                                     existing=data["existing"],
                                                     ttl_seconds=data["expires_minutes"] * 60)
        except BerthError as error:
            return self._page(form, error=error.message, status=error.status)
        server = request.build_absolute_uri("/").rstrip("/")
        return self._page(None, token=token, plaintext=plaintext,
                          command=f"manage.py agent --server {server} --token {plaintext}")

    def _page(self, form, status=200, **context):
        response = render(self.request, self.template_name, {"form": form, **context}, status=status)
        add_never_cache_headers(response)  # a token page must not be kept by any cache
        return response


class NodeLabelsView(StaffOnly, FleetMixin, ObjectAction):
    """POST the node's labels (staff only): what catalog profiles' node selectors match."""

    form_class = NodeLabelsForm

    def perform(self, node, data):
        node = services.set_labels(node, self.actor, data["labels"])
        messages.success(self.request, f"{node.name}'s labels are saved.")
        return node

    def success_url(self, node, result):
        return reverse("scheduler:node", kwargs={"public_id": node.public_id})


class EstimateView(LoginRequiredMixin, StaffOnly, View):
    """Will this fit, and what is it made of: the form, and its answer as a fragment. Staff only, as
    the API's: it reads any file under the model roots by path (others ask a model's card)."""

    template_name = "scheduler/estimate.html"
    fragment_template_name = "scheduler/estimate_result.html"

    def get(self, request):
        form = EstimateForm(request.GET or None)
        context = {"form": form}
        if request.GET and form.is_valid():
            context.update(self._answer(form))
        return render_page(request, self.template_name, self.fragment_template_name, context,
                           status=400 if context.get("error") else 200)

    post = get  # a form may post; nothing changes either way

    def _answer(self, form) -> dict:
        data = form.cleaned_data
        try:
            result = memory.estimate_and_fit(data["model_path"], data["engine"], form.engine_values(),
                                             node=data.get("node"), accelerator=data.get("accelerator"))
        except BerthError as error:
            return {"error": error}
        return {"result": estimate_payload(result)}


class PlacementMixin:
    """Placement decisions, read by those who see the model's owner (``reach.visible_decisions``)."""

    model = PlacementDecision

    def narrow(self, queryset):
        return reach.visible_decisions(self.request.user, queryset)

    def placement_context(self, query) -> dict:
        """The placement page's live part: decisions with ``query``'s filters, the parked and
        unplaceable lists (``query`` is the page's own query string, also when a retry answers)."""
        decisions = filtered(PlacementDecisionFilterSet(query, queryset=self.get_queryset(), request=self.request))
        lists = placement_service.parked_and_unplaceable(self.request.user)
        page = reverse("scheduler:placement")
        return {"filters": {k: query.get(k, "").strip() for k in ("model", "verdict", "kind")},
                "decisions": decisions[:200], "parked": ParkedModelTable(lists["parked"]),
                "unplaceable": UnplaceableModelTable(lists["unplaceable"]),
                "can_retry": reach.sees_everything(self.request.user),
                "live_url": f"{page}?{query.urlencode()}" if query else page,
                "verdicts": PlacementDecision.Verdict.choices, "kinds": PlacementDecision.Kind.choices}


class PlacementView(PlacementMixin, ConsolePage):
    """Placement decisions kept as evidence, with filters; the parked (with Retry, for staff) and
    unplaceable lists."""

    template_name = "scheduler/placement.html"
    fragment_template_name = "scheduler/placement_live.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(self.placement_context(self.request.GET))
        return context


class RetryParkedView(StaffOnly, PlacementMixin, ObjectAction):
    """POST: retry a parked model (staff only). HTMX gets the page's live part back, re-read with
    the filters the page shows; a plain form post is redirected to the page."""

    # htmx swaps only 2xx answers: a refusal (someone retried it first: not parked) is said in the
    # swapped part, or on the page a plain post is sent back to.
    page_refusals = (PermissionDenied,)

    def get_object(self):
        return self.kwargs["model"]

    def perform(self, model, data):
        recovery_service.retry(self.actor, model)
        messages.success(self.request, self.note(model))
        return model

    @staticmethod
    def note(model) -> str:
        return f"{model} will be placed again at the next pass."

    def success_url(self, model, result):
        return reverse("scheduler:placement")

    def fragment(self, model, result, error=None):
        list(messages.get_messages(self.request))  # the swapped part says how it went
        # The page's own URL (filters included) stays the fragment's polling URL.
        current = urlsplit(self.request.htmx.current_url_abs_path or "")
        query = QueryDict(current.query) if current.path == reverse("scheduler:placement") else QueryDict()
        return render(self.request, "scheduler/placement_live.html", {
            **self.placement_context(query), "retry_note": self.note(model) if error is None else "",
            "retry_error": error})
