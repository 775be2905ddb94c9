from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from berth.errors import InvalidInput
from scheduler.models import Accelerator, Node
from serving.api.serializers import (
    DeployInputSerializer,
    DeploymentEventSerializer,
    DeploymentSerializer,
    OperationSerializer,
    ReconfigureInputSerializer,
    SwitchInputSerializer,
)
from serving.deployments import gate, operations, service
from serving.deployments.service import visible_deployments
from serving.models import DeploymentState as S, Operation
from tenancy import access
from tenancy.audit import Actor
from tenancy.models import Scope
from tenancy.services.tree import resolve_scope


def deploy_request(request, data) -> service.DeployRequest:
    node = Node.objects.filter(name=data["node"]).first() or _by_id(Node, data["node"])
    if node is None:
        raise InvalidInput(f"No node {data['node']!r}.", details={"node": "unknown"})
    accelerator = None
    if data.get("accelerator"):
        accelerator = Accelerator.objects.filter(uuid=data["accelerator"], node=node).first()
        if accelerator is None:
            raise InvalidInput("No such accelerator on that node.", details={"accelerator": "unknown"})
    owner = None
    if data.get("owner"):
        owner = resolve_scope(data["owner"], access.visible_to(request.user, _scopes(), ""))
    return service.DeployRequest(name=data["name"], model_path=data["model_path"], node=node, engine=data["engine"],
                                 runtime=data["runtime"], task=data["task"], config=data.get("config") or {},
                                 accelerator=accelerator, owner=owner, priority=data["priority"],
                                 cores=data.get("cores"))


def _scopes():
    return Scope.objects.all()


def _by_id(model, value):
    import uuid

    try:
        return model.objects.filter(public_id=uuid.UUID(str(value))).first()
    except ValueError:
        return None


class DeploymentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Deployments: deploy, preview, start, stop, remove, and their events."""

    serializer_class = DeploymentSerializer
    lookup_field = "public_id"
    lookup_value_converter = "uuid"

    def get_queryset(self):
        return visible_deployments(self.request.user)

    @extend_schema(request=DeployInputSerializer, responses={201: DeploymentSerializer, 202: OperationSerializer})
    def create(self, request):
        """Deploy now (201), or — with a plan's ``actions`` — after freeing memory (202, an operation)."""
        data = _valid(DeployInputSerializer, request.data)
        if data.get("actions"):
            operation = operations.deploy_after(Actor.from_request(request), deploy_request(request, data),
                                                data["actions"])
            return Response(OperationSerializer(operation).data, status=status.HTTP_202_ACCEPTED)
        deployment = service.deploy(Actor.from_request(request), deploy_request(request, data))
        return Response(DeploymentSerializer(deployment).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=DeployInputSerializer, responses={200: dict})
    @action(detail=False, methods=["post"])
    def preview(self, request):
        """Will it fit, and what is it made of. Changes nothing."""
        data = _valid(DeployInputSerializer, request.data)
        result = service.preview(Actor.from_request(request), deploy_request(request, data))
        return Response(preview_body(result))

    @extend_schema(request=None, responses={200: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def stop(self, request, public_id=None):
        deployment = service.stop(Actor.from_request(request), self.get_object())
        return Response(DeploymentSerializer(deployment).data)

    @extend_schema(request=None, responses={200: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def start(self, request, public_id=None):
        deployment = service.start(Actor.from_request(request), self.get_object())
        return Response(DeploymentSerializer(deployment).data)

    @extend_schema(request=None, responses={200: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def sleep(self, request, public_id=None):
        deployment = service.sleep(Actor.from_request(request), self.get_object())
        return Response(DeploymentSerializer(deployment).data)

    @extend_schema(request=None, responses={200: DeploymentSerializer, 202: dict})
    @action(detail=True, methods=["post"])
    def wake(self, request, public_id=None):
        """Awake: 200 with the deployment. Not awake within ``SERVING_WAKE_WAIT_SECONDS`` (its wake waits
        for a start-up slot, or is waking): 202 with ``queued`` and ``position`` in line, while the wake goes on."""
        deployment = service.wake(Actor.from_request(request), self.get_object())
        if deployment.state != S.SLEEPING:
            return Response(DeploymentSerializer(deployment).data)
        position = gate.wake_position(deployment.replica_set.filter(state=S.SLEEPING))
        body = dict(DeploymentSerializer(deployment).data, queued=position is not None, position=position)
        return Response(body, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses={200: DeploymentEventSerializer(many=True)})
    @action(detail=True, methods=["get"])
    def events(self, request, public_id=None):
        events = self.get_object().events.select_related("replica")
        return Response(DeploymentEventSerializer(events, many=True).data)

    @extend_schema(request=SwitchInputSerializer, responses={202: OperationSerializer})
    @action(detail=True, methods=["post"])
    def switch(self, request, public_id=None):
        """Switch this deployment's model name to B, rolling back to A if B does not come up. Refused
        at once, changing nothing, when B is invalid (400) or would not fit in A's place (409, with
        the fit and its plans)."""
        source = self.get_object()
        data = _valid(SwitchInputSerializer, request.data)
        node = (Node.objects.filter(name=data["node"]).first() or _by_id(Node, data["node"])) if data.get("node") \
            else source.node
        if node is None:
            raise InvalidInput(f"No node {data['node']!r}.", details={"node": "unknown"})
        changes = {"model_path": data["model_path"], "config": data.get("config") or {}, "node": node,
                   "engine": data.get("engine") or source.engine, "runtime": data.get("runtime") or source.runtime}
        if node != source.node:  # A's accelerators stay on A's node
            changes.update(accelerator=None, shards=())
        if data.get("accelerator"):
            accelerator = Accelerator.objects.filter(uuid=data["accelerator"], node=node).first()
            if accelerator is None:
                raise InvalidInput("No such accelerator on that node.", details={"accelerator": "unknown"})
            changes.update(accelerator=accelerator, shards=())
        # B is A (its accelerators, shards, profile, owner, priority) but for what the request changes.
        target = service.DeployRequest.of(source, **changes)
        operation = operations.switch(Actor.from_request(request), source, target)
        return Response(OperationSerializer(operation).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=ReconfigureInputSerializer, responses={202: OperationSerializer})
    @action(detail=True, methods=["post"])
    def reconfigure(self, request, public_id=None):
        """Change engine settings in place: a switch to A with those settings (the same refusals)."""
        data = _valid(ReconfigureInputSerializer, request.data)
        operation = operations.reconfigure(Actor.from_request(request), self.get_object(), data["config"])
        return Response(OperationSerializer(operation).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses={200: OperationSerializer(many=True)})
    @action(detail=True, methods=["get"], url_path="operations")
    def operation_list(self, request, public_id=None):
        deployment = self.get_object()
        found = Operation.objects.filter(source=deployment) | Operation.objects.filter(target=deployment)
        return Response(OperationSerializer(found.distinct(), many=True).data)

    def destroy(self, request, public_id=None):
        service.remove(Actor.from_request(request), self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


def preview_body(result) -> dict:
    return {"estimate": result.estimate.as_dict(), "device": result.device,
            "fit": result.fit.as_dict() if result.fit else None, "notes": list(result.notes)}


def _valid(serializer_class, data) -> dict:
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data
