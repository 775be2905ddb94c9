"""The catalog and mirror under /api/serving/: models, files, fetch jobs, and the hub (search, files).
Rows are narrowed by the catalog's rules (``entries.visible_entries``, ``queries.visible_jobs``) in
the management API's base viewset (``tenancy.api.base``); bodies are read by its ``parsed``."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from berth.errors import PermissionDenied
from serving.catalog import entries, fetch, hub, placing, profiles, queries, restarts, room, servability, speed
from serving.control import serve_model as serve
from serving.models import FetchJob, ModelEntry, ModelFile
from tenancy import access
from tenancy.api.base import TenancyViewSet
from tenancy.services.tree import resolve_scope


class ModelFileSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name", default=None, allow_null=True, read_only=True,
                                 help_text="The node holding it; null: the control plane's own disk.")

    class Meta:
        model = ModelFile
        fields = ["public_id", "repo_path", "path", "size", "sha256", "expected_sha256", "verified", "quarantined",
                  "quarantine_reason", "node"]


class ModelEntrySerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.path", default=None)
    effective_class = serializers.CharField(
        read_only=True, help_text="The class placement gives the model: service_class, or when that is empty "
                                  "opportunistic on demand (scaling_min 0), else standard.")
    files = ModelFileSerializer(many=True, read_only=True)
    measured_tokens_per_second = serializers.SerializerMethodField(
        help_text="Generation speed per profile name, measured on the requests the gateway served; a profile "
                  "not measured yet is absent. Among profiles of equal priority placement tries the fastest "
                  "per accelerator or core first.")

    class Meta:
        model = ModelEntry
        fields = ["public_id", "name", "aliases", "description", "task", "owner", "source_kind", "source_repo",
                  "source_revision", "source_path", "source_package", "format", "quantisation", "architecture",
                  "profiles", "scaling_min", "scaling_max", "idle_timeout_seconds", "service_class", "effective_class",
                  "pinned", "fallbacks", "draft", "max_output_tokens", "fingerprint", "measured_tokens_per_second",
                  "restart_requested_at", "files", "created_at", "updated_at"]

    def get_measured_tokens_per_second(self, entry) -> dict[str, float]:
        speeds = self.context.get("speeds")
        if speeds is None:  # one entry on its own; a list passes every model's at once
            speeds = speed.measured([entry.name])
        return {profile: round(rate, 2) for (model, profile), rate in sorted(speeds.items()) if model == entry.name}


class ModelPlacementSerializer(serializers.Serializer):
    """What PATCH changes: a model's placement. A field left out stays as it is; the rules (max ≥ min,
    a minimum or a pin placement can meet, names the catalog holds, who may give the model to whom)
    are the catalog's (``serving.catalog.placing``)."""

    scaling_min = serializers.IntegerField(required=False, help_text="Replicas always running; 0: on demand.")
    scaling_max = serializers.IntegerField(required=False,
                                           help_text="Replicas at most under load; at least the minimum.")
    service_class = serializers.ChoiceField(
        choices=ModelEntry.ServiceClass.choices, allow_blank=True, required=False,
        help_text="critical > standard > opportunistic; empty: automatic "
                  "(opportunistic when on demand, else standard).")
    idle_timeout_seconds = serializers.IntegerField(
        required=False, allow_null=True, help_text="An on-demand replica idle this long is stopped; null: the default.")
    fallbacks = serializers.ListField(
        child=serializers.CharField(), required=False,
        help_text="Catalog models that answer in its place while it has no ready replica, and the recovery ladder's "
                  "smaller model after it runs out of memory.")
    draft = serializers.CharField(
        required=False, allow_blank=True, help_text="A catalog model that drafts tokens for it (speculative "
                                                    "decoding) in the same engine; empty: none.")
    pinned = serializers.BooleanField(required=False, help_text="Always resident, even at minimum 0; its replicas "
                                                                "are never evicted or preempted.")
    max_output_tokens = serializers.IntegerField(
        required=False, allow_null=True,
        help_text="The most tokens one request may generate: the gateway refuses a larger max_tokens "
                  "(max_tokens_above_cap) and sends this one when a request names none; null: no cap of its own.")
    owner = serializers.CharField(
        required=False, allow_null=True, allow_blank=True,
        help_text="A scope (project:acme/ml/search, its path or id) where you are member or above; "
                  "null or empty: shared (administrators only).")


class FetchJobSerializer(serializers.ModelSerializer):
    percent = serializers.IntegerField(read_only=True, allow_null=True, help_text="Null until the sizes are known.")
    model = serializers.CharField(source="model.name", default=None, allow_null=True, read_only=True,
                                  help_text="The catalog model it made; null until it has.")

    class Meta:
        model = FetchJob
        fields = ["public_id", "kind", "repo", "revision", "commit", "files", "status", "steps", "percent", "log",
                  "result", "error", "model", "created_at", "started_at", "finished_at"]


class FetchInputSerializer(serializers.Serializer):
    repo = serializers.CharField()
    revision = serializers.CharField(required=False, default="main")
    quant = serializers.CharField(required=False, allow_blank=True, default="")
    file = serializers.CharField(required=False, allow_blank=True, default="")
    patterns = serializers.ListField(child=serializers.CharField(), required=False, default=list)
    name = serializers.CharField(required=False, allow_blank=True, default="")
    owner = serializers.CharField(required=False, allow_blank=True, default="")
    allow_pickle = serializers.BooleanField(required=False, default=False)


class EntryViewSet(TenancyViewSet):
    """Catalog entries (and what hangs off them) the caller sees: shared ones and those of scopes
    within their reach (``entries.visible_entries``)."""

    def visible_entries(self):
        return entries.visible_entries(self.request.user).values("pk")


class CatalogModelViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, EntryViewSet):
    """Models the catalog holds; changing their placement; their servability; removing their files;
    garbage collection."""

    queryset = ModelEntry.objects.select_related("owner").prefetch_related("files__node")
    serializer_class = ModelEntrySerializer
    http_method_names = ["get", "post", "patch", "head", "options"]

    def narrow(self, queryset):
        return queryset.filter(pk__in=self.visible_entries())

    def get_serializer_context(self):
        context = super().get_serializer_context()
        if self.action == "list":
            context["speeds"] = speed.measured()
        return context

    @extend_schema(request=ModelPlacementSerializer, responses=ModelEntrySerializer)
    def partial_update(self, request, public_id=None):
        """Change the minimum, maximum, capacity class, idle timeout, pin, fallbacks, draft, output cap or owner —
        the console card's rules: a refusal names the field in ``details.problems``."""
        # A field this endpoint does not change (``name``) is refused: the caller learns that the
        # model was not renamed.
        values = dict(self.parsed(ModelPlacementSerializer, partial=True))
        # With its deployments: what runs counts toward a raised minimum.
        entry = queries.held(request.user, [self.get_object()], verdicts=False)[0]
        owner = placing.resolve_owner(request.user, values.pop("owner")) if "owner" in values else placing.KEEP
        entry = placing.change(self.actor, entry, values, owner=owner)
        return self.render(entry)

    @extend_schema(request=None, responses={200: dict})
    @action(detail=True, methods=["get"])
    def servability(self, request, public_id=None):
        entry = self.get_object()
        return Response(servability.check_entry(entry).as_dict())

    @extend_schema(request=None, responses={200: dict})
    @action(detail=True, methods=["get"])
    def room(self, request, public_id=None):
        """Where the model runs, and how many more replicas fit where (headroom, or the fit planner)."""
        entry = queries.held(request.user, [self.get_object()])[0]
        more = room.room_for_more(entry)
        return Response({"placement": entry.placement, "more": more.more, "nodes": more.nodes,
                         "blocked": more.blocked, "source": more.source, "per_replica_bytes": more.per_replica_bytes,
                         "note": more.note})

    @extend_schema(request=None, responses={200: dict, 202: dict})
    @action(detail=True, methods=["get", "post"])
    def restart(self, request, public_id=None):
        """POST: a rolling restart — each replica replaced by a fresh one, one at a time, the new one
        ready before the old stops; 202 with where it stands, 409 ``nothing_to_restart`` when none
        runs, 403 without member on the model's owner. GET: where the last one stands (``restart``
        null: none under way) — ``state`` waiting or blocked, and ``detail`` why."""
        entry = self.get_object()
        if request.method == "POST":
            entry = restarts.restart(self.actor, entry)
        return Response({"model": entry.name, "restart": restarts.progress(entry)},
                        status=status.HTTP_202_ACCEPTED if request.method == "POST" else status.HTTP_200_OK)

    @extend_schema(request=None, responses={200: dict})
    @action(detail=True, methods=["post"], url_path="remove-files")
    def remove_files(self, request, public_id=None):
        return Response({"removed": entries.remove_files(self.actor, self.get_object())})

    @extend_schema(request=None, responses={200: dict})
    @action(detail=False, methods=["post"], url_path="garbage-collect")
    def garbage_collect(self, request):
        if not access.is_superuser(request.user):
            raise PermissionDenied("Only administrators collect the mirror's garbage.")
        return Response(entries.garbage_collect(self.actor))


class ModelFileViewSet(mixins.ListModelMixin, EntryViewSet):
    """The files of the models the caller sees."""

    queryset = ModelFile.objects.select_related("node")
    serializer_class = ModelFileSerializer

    def narrow(self, queryset):
        return queryset.filter(model__in=self.visible_entries())


class FetchJobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """Fetches from the hub: start one (refused up front with the reason), follow it, resume it."""

    queryset = FetchJob.objects.select_related("owner", "model")
    serializer_class = FetchJobSerializer

    def narrow(self, queryset):
        return queries.visible_jobs(self.request.user, queryset)

    @extend_schema(request=FetchInputSerializer, responses={202: FetchJobSerializer})
    def create(self, request):
        values = self.parsed(FetchInputSerializer)
        owner = resolve_scope(values["owner"], self.visible_scopes()) if values["owner"] else None
        job = fetch.start(self.actor, fetch.FetchRequest(
            repo=values["repo"], revision=values["revision"], quant=values["quant"] or None,
            file=values["file"] or None, patterns=tuple(values["patterns"]), name=values["name"] or None,
            owner=owner, allow_pickle=values["allow_pickle"]))
        return self.render(job, status_code=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: FetchJobSerializer})
    @action(detail=True, methods=["post"])
    def resume(self, request, public_id=None):
        return self.render(fetch.resume(self.actor, self.get_object()), status_code=status.HTTP_202_ACCEPTED)


class HubViewSet(viewsets.ViewSet):
    """The hub, read through the mirror: search, and one repository's files grouped by quantisation."""

    @extend_schema(responses={200: dict})
    @action(detail=False, methods=["get"])
    def search(self, request):
        return Response({"results": hub.search(request.query_params.get("q", ""))})

    @extend_schema(responses={200: dict})
    @action(detail=False, methods=["get"])
    def files(self, request):
        listing = hub.repository(request.query_params.get("repo", ""), request.query_params.get("revision") or "main")
        return Response({"repo": listing.repo, "commit": listing.commit, "gated": listing.gated,
                         "sets": [{"name": s.name, "quantisation": s.quantisation, "format": s.format, "size": s.size,
                                   "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in s.files]}
                                  for s in listing.file_sets()]})


class ServeInputSerializer(serializers.Serializer):
    repo = serializers.CharField()
    revision = serializers.CharField(required=False, default="main")
    quant = serializers.CharField(required=False, allow_blank=True, default="")
    file = serializers.CharField(required=False, allow_blank=True, default="")
    name = serializers.CharField(required=False, allow_blank=True, default="")
    owner = serializers.CharField(required=False, allow_blank=True, default="")
    node = serializers.CharField(required=False, allow_blank=True, default="")
    context = serializers.IntegerField(required=False, min_value=1, default=profiles.DEFAULT_CONTEXT)
    on_demand = serializers.BooleanField(required=False, default=False)


class ServeViewSet(TenancyViewSet):
    """Serve a hub model in one command: the job ``manage.py serve_model`` runs, on the control
    queue. 202 with the job's row; follow it at ``catalog/fetches/<id>/`` (its ``steps``). A viewset
    (POST only) for the base's ``parsed``: a field the command does not take is refused."""

    @extend_schema(request=ServeInputSerializer, responses={202: FetchJobSerializer})
    def create(self, request):
        job = serve.start_from_values(self.actor, request.user, self.parsed(ServeInputSerializer))
        return self.render(job, FetchJobSerializer, status.HTTP_202_ACCEPTED)
