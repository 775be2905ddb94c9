from django.contrib.auth.mixins import LoginRequiredMixin

from berth.htmx import PageView


class DashboardView(LoginRequiredMixin, PageView):
    """The landing page. Until the areas it summarises exist it says so, rather than invent figures."""

    template_name = "dashboard.html"
    fragment_template_name = "dashboard_fragment.html"

    def get_context_data(self, **kwargs):
        from scheduler.models import Node

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
