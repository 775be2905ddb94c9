from django.contrib.auth.mixins import LoginRequiredMixin

from berth.htmx import PageView
from scheduler.filtersets import NodeFilterSet
from scheduler.models import Node
from scheduler.tables import NodeTable


class FleetView(LoginRequiredMixin, PageView):
    """The fleet's nodes; the table refreshes itself through the same URL's fragment."""

    template_name = "scheduler/fleet.html"
    fragment_template_name = "scheduler/fleet_table.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        filterset = NodeFilterSet(self.request.GET, queryset=Node.objects.prefetch_related("engines"))
        context["filterset"] = filterset
        context["table"] = NodeTable(filterset.qs)
        return context
