from urllib.parse import urlsplit

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin, UserPassesTestMixin
from django.db.models import Prefetch
from django.http import QueryDict
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.cache import patch_vary_headers
from django.views import View

from berth.errors import BerthError
from berth.htmx import PageView, render_page, wants_fragment
from scheduler import memory, reach, services
from scheduler.filtersets import NodeFilterSet
from scheduler.forms import EstimateForm, NodeActionForm
from scheduler.models import Accelerator, AcceleratorSample, ModelDirectory, Node, NodeSample
from scheduler.presenting import estimate_payload
from scheduler.tables import AcceleratorTable, NodeTable, ParkedModelTable, UnplaceableModelTable
from tenancy import audit


def _accelerators():
    return Accelerator.objects.select_related("node").prefetch_related("reservations").order_by(
        "node__name", "index", "mig_index")


class FleetView(LoginRequiredMixin, PageView):
    """The fleet's nodes and accelerators; the tables refresh themselves through the same URL's fragment."""

    template_name = "scheduler/fleet.html"
    fragment_template_name = "scheduler/fleet_table.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        filterset = NodeFilterSet(self.request.GET, queryset=Node.objects.prefetch_related(
            "engines", Prefetch("accelerators", queryset=Accelerator.objects.all())))
        context["filterset"] = filterset
        context["table"] = NodeTable(filterset.qs)
        context["accelerators"] = AcceleratorTable(_accelerators().filter(node__in=filterset.qs),
                                                   empty_message="No GPUs reported by these nodes.")
        context["can_estimate"] = reach.sees_everything(self.request.user)
        return context


class NodeDetailView(LoginRequiredMixin, PageView):
    """A node's capacity and telemetry; what its model directories hold is shown to staff only."""

    template_name = "scheduler/node.html"
    fragment_template_name = "scheduler/node_live.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        sees_files = reach.sees_everything(self.request.user)
        nodes = Node.objects.prefetch_related("engines")
        if sees_files:
            nodes = nodes.prefetch_related(
                Prefetch("model_directories", queryset=ModelDirectory.objects.prefetch_related("weights")))
        node = get_object_or_404(nodes, public_id=kwargs["public_id"])
        context["node"] = node
        context["sees_files"] = sees_files
        context["accelerators"] = AcceleratorTable(_accelerators().filter(node=node),
                                                   empty_message=node.gpu_note or "No GPUs reported.")
        context["node_samples"] = NodeSample.objects.filter(node=node)[:20]
        context["gpu_samples"] = (AcceleratorSample.objects.filter(accelerator__node=node)
                                  .select_related("accelerator")[:40])
        context["can_act"] = reach.sees_everything(self.request.user)
        context["actions"] = [verb for verb, (allowed, _) in services._TRANSITIONS.items() if node.state in allowed]
        return context


class NodeActionView(LoginRequiredMixin, UserPassesTestMixin, View):
    """POST cordon / uncordon / drain: staff only until tenancy's permissions cover the fleet."""

    verbs = {"cordon": services.cordon, "uncordon": services.uncordon, "drain": services.drain}

    def test_func(self):
        return reach.sees_everything(self.request.user)

    def post(self, request, public_id, verb):
        node = get_object_or_404(Node, public_id=public_id)
        if verb not in self.verbs:
            return redirect("scheduler:node", public_id=public_id)
        form = NodeActionForm(request.POST)
        reason = form.cleaned_data["reason"] if form.is_valid() else ""
        try:
            node = self.verbs[verb](node, audit.Actor.from_request(request), reason=reason)
            messages.success(request, f"{node.name} is {node.get_state_display().lower()}.")
        except BerthError as error:
            messages.error(request, error.message)
        return redirect("scheduler:node", public_id=public_id)


class EstimateView(LoginRequiredMixin, UserPassesTestMixin, View):
    """Will this fit, and what is it made of: the form, and its answer as a fragment. Staff only, as
    the API's: it reads any file under the model roots by path (others ask a model's card)."""

    template_name = "scheduler/estimate.html"
    fragment_template_name = "scheduler/estimate_result.html"

    def test_func(self):
        return reach.sees_everything(self.request.user)

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


def placement_context(request, query) -> dict:
    """The placement page's live part: decisions with ``query``'s filters, the parked and
    unplaceable lists (``query`` is the page's own query string, also when a retry answers)."""
    from scheduler import placement_service
    from scheduler.models import PlacementDecision

    filters = {k: query.get(k, "").strip() for k in ("model", "verdict", "kind")}
    rows = reach.visible_decisions(request.user, PlacementDecision.objects.all())
    for field, value in filters.items():
        if value:
            rows = rows.filter(**{field: value})
    lists = placement_service.parked_and_unplaceable(request.user)
    page = reverse("scheduler:placement")
    return {"filters": filters, "decisions": rows[:200], "parked": ParkedModelTable(lists["parked"]),
            "unplaceable": UnplaceableModelTable(lists["unplaceable"]),
            "can_retry": reach.sees_everything(request.user),
            "live_url": f"{page}?{query.urlencode()}" if query else page,
            "verdicts": PlacementDecision.Verdict.choices, "kinds": PlacementDecision.Kind.choices}


class PlacementView(LoginRequiredMixin, PageView):
    """Placement decisions kept as evidence, with filters; the parked (with Retry, for staff) and
    unplaceable lists."""

    template_name = "scheduler/placement.html"
    fragment_template_name = "scheduler/placement_live.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(placement_context(self.request, self.request.GET))
        return context


class RetryParkedView(LoginRequiredMixin, UserPassesTestMixin, View):
    """POST: retry a parked model (staff only). HTMX gets the page's live part back, re-read with
    the filters the page shows; a plain form post is redirected to the page."""

    def test_func(self):
        return reach.sees_everything(self.request.user)

    def post(self, request, model):
        from scheduler import recovery_service

        note, error = "", None
        try:
            recovery_service.retry(audit.Actor.from_request(request), model)
            note = f"{model} will be placed again at the next pass."
        except BerthError as refusal:
            error = refusal
        if not wants_fragment(request):
            if error is not None:
                messages.error(request, error.message)
            else:
                messages.success(request, note)
            return redirect("scheduler:placement")
        # The page's own URL (filters included) stays the fragment's polling URL.
        current = urlsplit(request.htmx.current_url_abs_path or "")
        query = QueryDict(current.query) if current.path == reverse("scheduler:placement") else QueryDict()
        context = {**placement_context(request, query), "retry_note": note, "retry_error": error}
        # htmx swaps only 2xx answers: a refusal (someone retried it first) is said in the swapped part.
        response = render(request, "scheduler/placement_live.html", context)
        patch_vary_headers(response, ("HX-Request",))
        return response
