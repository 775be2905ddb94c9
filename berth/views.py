from django.contrib.auth.mixins import LoginRequiredMixin
from django.http import JsonResponse
from django.views.defaults import page_not_found, server_error as default_server_error

from berth.api import error_body
from berth.htmx import PageView
from scheduler.models import Node


class DashboardView(LoginRequiredMixin, PageView):
    """The landing page. Until the areas it summarises exist it says so, rather than invent figures."""

    template_name = "dashboard.html"
    fragment_template_name = "dashboard_fragment.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["node_count"] = Node.objects.count()
        context["nodes_ready"] = Node.objects.filter(state=Node.State.READY).count()
        return context


class AreaPlaceholderView(LoginRequiredMixin, PageView):
    """An area of the console whose pages are not built yet: it lists what is coming, plainly."""

    template_name = "area_placeholder.html"
    title = ""
    summary = ""
    coming: tuple[str, ...] = ()

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(title=self.title, summary=self.summary, coming=self.coming)
        return context


def _wants_json(request) -> bool:
    return request.path.startswith("/api/")


def not_found(request, exception=None):
    """Outside any view (an unknown URL): the API's error shape under /api/, a page elsewhere."""
    if _wants_json(request):
        return JsonResponse(error_body("not_found", "No such endpoint or object."), status=404)
    return page_not_found(request, exception)


def server_error(request):
    if _wants_json(request):
        return JsonResponse(error_body("internal_error", "Something went wrong on our side; it has been logged."),
                            status=500)
    return default_server_error(request)
