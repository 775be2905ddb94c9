import dataclasses

from django.db.models import Prefetch
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, permissions, status
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from scheduler import enrolment, memory, placement_service, reach, recovery_service, services
from scheduler.api.node_auth import IsNode, NodeAuthentication
from scheduler.api.serializers import (
    AcceleratorSerializer,
    CalibrationRecordSerializer,
    EnrolmentTokenRequestSerializer,
    EnrolmentTokenSerializer,
    EnrolRequestSerializer,
    EstimateRequestSerializer,
    IssuedEnrolmentTokenSerializer,
    NodeActionSerializer,
    NodeLabelsSerializer,
    NodeSerializer,
    ParkedAndUnplaceableSerializer,
    ParkedModelSerializer,
    PlacementDecisionSerializer,
    PolicyModelSerializer,
)
from scheduler.errors import FleetFilesForStaff
from scheduler.filtersets import (
    AcceleratorFilterSet,
    CalibrationRecordFilterSet,
    NodeFilterSet,
    PlacementDecisionFilterSet,
)
from scheduler.models import Accelerator, CalibrationRecord, EnrolmentToken, ModelDirectory, Node, PlacementDecision
from scheduler.presenting import estimate_payload
from scheduler.snapshot import current_snapshot
from tenancy import audit
from tenancy.api.base import TenancyViewSet


class IsStaff(permissions.BasePermission):
    """Fleet changes, and the fleet's evidence about every tenant's models, are for staff until
    tenancy's permissions cover the fleet."""

    message = "Only staff may do this with the fleet."

    def has_permission(self, request, view):
        return reach.sees_everything(request.user)


def _accelerators():
    return Accelerator.objects.select_related("node", "parent").prefetch_related("reservations")


class FleetViewSet(TenancyViewSet):
    """The fleet's capacity is everyone's to read (``scheduler.reach``): its rows are not narrowed."""

    def narrow(self, queryset):
        return queryset


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, FleetViewSet):
    """The fleet's nodes, looked up by their public id; cordon, uncordon and drain are actions.
    ``model_directories`` (paths and files) are shown to staff only."""

    queryset = Node.objects.prefetch_related(
        "engines", Prefetch("accelerators", queryset=_accelerators()),
        Prefetch("model_directories", queryset=ModelDirectory.objects.prefetch_related("weights")))
    serializer_class = NodeSerializer
    filterset_class = NodeFilterSet

    def _act(self, request, verb):
        node = self.get_object()
        reason = self.parsed(NodeActionSerializer)["reason"]
        node = getattr(services, verb)(node, self.actor, reason=reason)
        return self.render(self.get_queryset().get(pk=node.pk))

    @action(detail=True, methods=["post"], permission_classes=[IsStaff])
    def cordon(self, request, public_id=None):
        return self._act(request, "cordon")

    @action(detail=True, methods=["post"], permission_classes=[IsStaff])
    def uncordon(self, request, public_id=None):
        return self._act(request, "uncordon")

    @action(detail=True, methods=["post"], permission_classes=[IsStaff])
    def drain(self, request, public_id=None):
        return self._act(request, "drain")

    @extend_schema(request=None, responses={200: dict})
    @action(detail=True, methods=["get"], permission_classes=[IsStaff])
    def moves(self, request, public_id=None):
        """What the last placement pass is moving off the node (draining, or a rolling restart's next):
        each replica's model, ``state`` (waiting for its replacement, blocked, stopping) and ``detail``
        — for a blocked one, why it cannot be moved. Staff only: it names every tenant's models.
        ``moves`` null: the cache does not answer, so it is not known."""
        node = self.get_object()
        found = placement_service.moves(node=node.name)
        return Response({"node": node.name, "state": node.state,
                         "moves": None if found is None else [dataclasses.asdict(m) for m in found]})

    @extend_schema(request=NodeLabelsSerializer, responses={200: NodeSerializer})
    @action(detail=True, methods=["put"], permission_classes=[IsStaff])
    def labels(self, request, public_id=None):
        """PUT the node's labels ({"labels": {"zone": "a"}}, all of them): what catalog profiles'
        node selectors match. Staff only; 400 ``invalid_node_labels`` names what is wrong."""
        node = self.get_object()
        node = services.set_labels(node, self.actor, self.parsed(NodeLabelsSerializer)["labels"])
        return self.render(self.get_queryset().get(pk=node.pk))


    @extend_schema(request=None, responses={200: NodeSerializer})
    @action(detail=True, methods=["post"], permission_classes=[IsStaff])
    def revoke(self, request, public_id=None):
        """Revoke the node's credential: the node API refuses it from the next request on (401
        ``node_revoked``). The node stays, shown revoked; a token issued for it (``existing``) enrols it
        again. Staff only."""
        node = enrolment.revoke(self.actor, self.get_object())
        return self.render(self.get_queryset().get(pk=node.pk))


class EnrolmentTokenViewSet(mixins.ListModelMixin, mixins.DestroyModelMixin, FleetViewSet):
    """One-time tokens that enrol a node (``manage.py agent --server URL --token T``). The answer to a
    creation carries the token (``bne_…``) once; lists never do. DELETE withdraws one not yet used
    (409 ``enrolment_token_used`` otherwise). Staff only."""

    permission_classes = [IsStaff]
    queryset = EnrolmentToken.objects.select_related("node", "used_by_node")
    serializer_class = EnrolmentTokenSerializer

    @extend_schema(request=EnrolmentTokenRequestSerializer, responses={201: IssuedEnrolmentTokenSerializer})
    def create(self, request):
        data = self.parsed(EnrolmentTokenRequestSerializer)
        token, plaintext = enrolment.issue_token(self.actor, name=data["name"], existing=data["existing"] or None,
                                                 ttl_seconds=data["expires_minutes"] * 60)
        return self.render(self.get_queryset().get(pk=token.pk), IssuedEnrolmentTokenSerializer,
                           status_code=status.HTTP_201_CREATED, plaintext=plaintext)

    def destroy(self, request, *args, **kwargs):
        enrolment.withdraw_token(self.actor, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class AcceleratorViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, FleetViewSet):
    """GPUs and MIG instances with class, memory, reservations, telemetry and placeability."""

    queryset = _accelerators()
    serializer_class = AcceleratorSerializer
    filterset_class = AcceleratorFilterSet


class EstimateView(APIView):
    """POST a model path, engine and configuration (and optionally a node or accelerator):
    the estimate with its breakdown, and the fit with plans. Staff only (403
    ``fleet_files_for_staff``): it reads any file under the model roots, whoever's catalog entry it
    is behind. Others ask the catalog for a model they see (``…/catalog/models/{id}/room/``)."""

    @extend_schema(request=EstimateRequestSerializer,
                   responses={200: dict, 403: OpenApiResponse(description="fleet_files_for_staff")})
    def post(self, request):
        if not reach.sees_everything(request.user):
            raise FleetFilesForStaff("Estimating a file by its path is for staff; estimate a model you can see "
                                     "through the catalog (GET /api/serving/catalog/models/{id}/room/).")
        body = EstimateRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        node = get_object_or_404(Node, public_id=data["node"]) if data.get("node") else None
        accelerator = (get_object_or_404(Accelerator.objects.select_related("node"), public_id=data["accelerator"])
                       if data.get("accelerator") else None)
        result = memory.estimate_and_fit(data["model_path"], data["engine"], data.get("config"),
                                         engine_version=data.get("engine_version"), node=node, accelerator=accelerator)
        return Response(estimate_payload(result))


class CalibrationRecordViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                               FleetViewSet):
    """What loads really used against their estimates. Deleting a record (or ``reset`` with the
    list's filters) makes later estimates go back to the formulas. For staff only, reads too: a
    record names the model and file it measured and why a load failed, whoever's model it was."""

    permission_classes = [IsStaff]
    queryset = CalibrationRecord.objects.all()
    serializer_class = CalibrationRecordSerializer
    filterset_class = CalibrationRecordFilterSet

    def destroy(self, request, *args, **kwargs):
        record = self.get_object()
        memory.reset_calibration(CalibrationRecord.objects.filter(pk=record.pk), self.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @action(detail=False, methods=["post"])
    def reset(self, request):
        records = self.filter_queryset(self.get_queryset())
        count = memory.reset_calibration(records, self.actor)
        return Response({"deleted": count})


# --- placement policy: decisions, explain, headroom ------------------------------------------------

class PlacementDecisionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """Placement decisions kept as evidence; filter with ?model=, ?verdict=, ?kind= (as the console's
    placement page does). Staff see every decision; others those about models of scopes they see
    (``scheduler.reach``)."""

    queryset = PlacementDecision.objects.all()
    serializer_class = PlacementDecisionSerializer
    filterset_class = PlacementDecisionFilterSet

    def narrow(self, queryset):
        return reach.visible_decisions(self.request.user, queryset)


class _DryRunView(APIView):
    def _model(self, request):
        body = PolicyModelSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        # The owner's contracts decide the answer, and the refusals name them with their figures:
        # resolved among the scopes the caller sees (404 otherwise), never taken as written.
        owner = reach.resolve_owner(request.user, body.validated_data["owner"])
        return body, body.desired(owner=owner.path if owner else "")


class ExplainPlacementView(_DryRunView):
    """POST a model's shape: per profile and node, why its next replica would be rejected.
    An always-running count (min) that placement cannot meet is said so, with the reason."""

    @extend_schema(request=PolicyModelSerializer, responses={200: dict})
    def post(self, request):
        _, model = self._model(request)
        answer = placement_service.explain_placement(current_snapshot((model,)), model.id)
        return Response(answer)


class HeadroomView(_DryRunView):
    """POST a model's shape: how many more replicas fit, by a dry run on a copy."""

    @extend_schema(request=PolicyModelSerializer, responses={200: dict})
    def post(self, request):
        body, model = self._model(request)
        return Response(placement_service.headroom(current_snapshot((model,)), model.id,
                                                   limit=body.validated_data["limit"]))


class ParkedUnplaceableView(APIView):
    """The parked models (with the last failure's kind, how many in a row, the last error and since
    when) and the unplaceable ones (their latest decision is unschedulable), with why: the models
    whose decisions the caller may read."""

    @extend_schema(responses={200: ParkedAndUnplaceableSerializer})
    def get(self, request):
        return Response(ParkedAndUnplaceableSerializer(placement_service.parked_and_unplaceable(request.user)).data)


class RetryParkedView(APIView):
    """POST: an operator's retry of a parked model. Its failure memory is reset (and the retry
    audited) so the next placement pass launches it again. 404 ``model_not_parked`` when it is not
    parked."""

    permission_classes = [IsStaff]

    @extend_schema(request=None, responses={200: ParkedModelSerializer,
                                            404: OpenApiResponse(description="model_not_parked")})
    def post(self, request, model):
        row = recovery_service.retry(audit.Actor.from_request(request), model)
        return Response(ParkedModelSerializer(recovery_service.describe(row)).data)


# --- the node API's one unauthenticated call ------------------------------------------------------

class EnrolView(APIView):
    """POST an enrolment token with this node's name and address: the node's own credential
    (``bnc_…``, shown once: keep it, mode 0600), and the token is spent. 401
    ``enrolment_token_invalid`` / ``enrolment_token_expired`` / ``enrolment_token_spent``; 409
    ``node_name_taken`` when a node of that name was enrolled already and the token is not for it;
    400 ``invalid_node_report`` for a bad name or address. No other credential is taken here."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]

    @extend_schema(request=EnrolRequestSerializer, responses={
        201: dict, 401: OpenApiResponse(description="enrolment_token_invalid, _expired or _spent"),
        409: OpenApiResponse(description="node_name_taken")})
    def post(self, request):
        body = EnrolRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        node, credential = enrolment.enrol(data["token"], name=data["name"], address=data["address"],
                                           remote_address=request.META.get("REMOTE_ADDR") or None)
        return Response({"node": {"id": str(node.public_id), "name": node.name}, "credential": credential},
                        status=status.HTTP_201_CREATED)


class NodeSelfView(APIView):
    """GET with a node's credential: which node it is (``doctor`` on a node checks its credential with
    this). 401 ``node_credential_invalid`` / ``node_revoked``."""

    authentication_classes = [NodeAuthentication]
    permission_classes = [IsNode]

    @extend_schema(responses={200: dict, 401: OpenApiResponse(description="node_credential_invalid or node_revoked")})
    def get(self, request):
        node = request.auth
        return Response({"id": str(node.public_id), "name": node.name, "state": node.state,
                         "credential_issued_at": node.credential_issued_at})
