"""The gateway's management API: usage records, model splits and the Batch API's batches, narrowed to
the caller's scopes by the management API's base viewset (``tenancy.api.base``) before any filter."""

from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.response import Response

from berth.errors import NotFound
from gateway import services
from gateway.api.serializers import BatchSerializer, ModelSplitSerializer, UsageRecordSerializer
from gateway.filtersets import BatchFilterSet, UsageRecordFilterSet
from gateway.models import Batch, ModelSplit, UsageRecord
from tenancy import access
from tenancy.api.base import TenancyViewSet
from tenancy.models import Scope


class UsageRecordViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """Usage: one record per request through /v1/ (no content). Look one up by its request id."""

    queryset = UsageRecord.objects.select_related("client")
    serializer_class = UsageRecordSerializer
    filterset_class = UsageRecordFilterSet
    lookup_field = "request_id"
    lookup_value_regex = "[A-Za-z0-9._:-]+"

    def narrow(self, queryset):
        return services.visible_usage(self.request.user, queryset)

    def get_object(self):
        # Client-chosen request ids may repeat: the latest record wins; none visible is a 404.
        record = self.filter_queryset(self.get_queryset()).filter(
            request_id=self.kwargs["request_id"]).order_by("-started_at").first()
        if record is None:
            raise Http404
        return record


class ModelSplitViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                        mixins.UpdateModelMixin, mixins.DestroyModelMixin, TenancyViewSet):
    """Model splits: requests for ``model_name`` served by its variants by weight, sticky per client,
    optionally only for some client environments. Staff manage fleet-wide splits (``scope`` null); a
    scope's admins manage the splits of their scope, which apply to its clients and below."""

    queryset = ModelSplit.objects.select_related("scope")
    serializer_class = ModelSplitSerializer

    def narrow(self, queryset):
        return services.visible_splits(self.request.user, queryset)

    def _scope(self, path):
        if not path:
            return None
        scope = Scope.objects.filter(path=path.strip("/")).first()
        if scope is None or not (access.can(self.request.user, "view", scope)
                                 or services.may_manage_split(self.request.user, None)):  # staff
            raise NotFound("No such scope, or it is outside your reach.", details={"scope": path})
        return scope

    def _save(self, split, partial: bool):
        data = self.parsed(ModelSplitSerializer, partial=partial)
        current = {"model_name": split.model_name, "scope": split.scope.path if split and split.scope_id else None,
                   "variants": split.variants, "environments": split.environments, "enabled": split.enabled,
                   "note": split.note} if split is not None else {}
        fields = {**current, **data} if partial else data
        saved = services.save_split(self.request.user, split, model_name=fields["model_name"],
                                    scope=self._scope(fields.get("scope")), variants=list(fields.get("variants", [])),
                                    environments=list(fields.get("environments", [])),
                                    enabled=fields.get("enabled", True), note=fields.get("note", ""))
        return self.get_serializer(saved).data

    def create(self, request, *args, **kwargs):
        return Response(self._save(None, partial=False), status=status.HTTP_201_CREATED)

    def update(self, request, *args, **kwargs):
        return Response(self._save(self.get_object(), partial=kwargs.get("partial", False)))

    def destroy(self, request, *args, **kwargs):
        services.delete_split(request.user, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class BatchViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """The Batch API's batches (created by key holders under /v1/batches), for the people and
    management clients of their client's project: newest first, looked up by their id (``batch_…``).
    Cancelling needs member (or above) of that project; a batch that has ended is ``batch_ended`` (409)."""

    queryset = Batch.objects.select_related("client__project", "credential", "input_file", "output_file",
                                            "error_file").order_by("-created_at", "-id")
    serializer_class = BatchSerializer
    filterset_class = BatchFilterSet
    lookup_value_regex = "batch_[0-9A-Za-z]{1,34}"

    def narrow(self, queryset):
        return services.visible_batches(self.request.user, queryset)

    @extend_schema(request=None, responses=BatchSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request, public_id=None):
        """Stop sending its lines: those in flight finish, the rest go to its error file as
        ``batch_cancelled``. Cancelling a batch that is already cancelling changes nothing."""
        return self.render(services.cancel_batch(self.actor, self.get_object()))
