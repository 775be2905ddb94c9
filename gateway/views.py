from django.contrib.auth.mixins import LoginRequiredMixin

from berth.htmx import PageView
from gateway import services
from gateway.filtersets import UsageRecordFilterSet


class IndexView(LoginRequiredMixin, PageView):
    """Recent requests (one line each), usage by model and day, and one request by its id."""

    template_name = "gateway/index.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        visible = services.visible_usage(self.request.user)
        filterset = UsageRecordFilterSet(self.request.GET or None, queryset=visible)
        records = filterset.qs if filterset.is_bound and filterset.is_valid() else visible
        context.update(filterset=filterset, records=records.order_by("-started_at")[:100],
                       totals=services.totals_by_model_and_day(visible))
        return context
