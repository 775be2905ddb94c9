"""Deployments under /api/serving/deployments/: deploy, preview, the verbs, switch and reconfigure,
events and operations. Rows are narrowed by serving's one rule (``visible_deployments``) in the
management API's base viewset (``tenancy.api.base``); the list reads the console's FilterSet."""

import re

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status
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
from serving.deployments.filters import DeploymentFilterSet
from serving.deployments.service import visible_deployments
from serving.models import Deployment, DeploymentState as S, Operation
from tenancy.api.base import UUID_PATTERN, TenancyViewSet
from tenancy.services.tree import resolve_scope


def _node(written: str) -> Node:
    """A node by its name, or by its id (the fleet is everyone's to name)."""
    node = Node.objects.filter(name=written).first()
    if node is None and re.fullmatch(UUID_PATTERN, written):
        node = Node.objects.filter(public_id=written).first()
    if node is None:
        raise InvalidInput(f"No node {written!r}.", details={"node": "unknown"})
    return node


def _accelerator(uuid: str, node: Node) -> Accelerator:
    accelerator = Accelerator.objects.filter(uuid=uuid, node=node).first()
    if accelerator is None:
        raise InvalidInput("No such accelerator on that node.", details={"accelerator": "unknown"})
    return accelerator


class DeploymentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """Deployments: deploy, preview, start, stop, remove, and their events. The list filters with
    ?q=, ?state=, ?engine=, ?node= (a node's name), as the console's Models page does."""

    queryset = Deployment.objects.select_related("node", "owner").prefetch_related("replica_set__node")
    serializer_class = DeploymentSerializer
    filterset_class = DeploymentFilterSet

    def narrow(self, queryset):
        return queryset.filter(pk__in=visible_deployments(self.request.user).values("pk"))

    def deploy_request(self, data) -> service.DeployRequest:
        node = _node(data["node"])
        accelerator = _accelerator(data["accelerator"], node) if data.get("accelerator") else None
        owner = resolve_scope(data["owner"], self.visible_scopes()) if data.get("owner") else None
        return service.DeployRequest(name=data["name"], model_path=data["model_path"], node=node,
                                     engine=data["engine"], runtime=data["runtime"], task=data["task"],
                                     config=data.get("config") or {}, accelerator=accelerator, owner=owner,
                                     priority=data["priority"], cores=data.get("cores"))

    @extend_schema(request=DeployInputSerializer, responses={201: DeploymentSerializer, 202: OperationSerializer})
    def create(self, request):
        """Deploy now (201), or — with a plan's ``actions`` — after freeing memory (202, an operation)."""
        data = self.parsed(DeployInputSerializer)
        if data.get("actions"):
            operation = operations.deploy_after(self.actor, self.deploy_request(data), data["actions"])
            return self.render(operation, OperationSerializer, status.HTTP_202_ACCEPTED)
        deployment = service.deploy(self.actor, self.deploy_request(data))
        return self.render(deployment, status_code=status.HTTP_201_CREATED)

    @extend_schema(request=DeployInputSerializer, responses={200: dict})
    @action(detail=False, methods=["post"])
    def preview(self, request):
        """Will it fit, and what is it made of. Changes nothing."""
        result = service.preview(self.actor, self.deploy_request(self.parsed(DeployInputSerializer)))
        return Response(preview_body(result))

    @extend_schema(request=None, responses={200: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def stop(self, request, public_id=None):
        return self.render(service.stop(self.actor, self.get_object()))

    @extend_schema(request=None, responses={200: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def start(self, request, public_id=None):
        return self.render(service.start(self.actor, self.get_object()))

    @extend_schema(request=None, responses={200: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def sleep(self, request, public_id=None):
        return self.render(service.sleep(self.actor, self.get_object()))

    @extend_schema(request=None, responses={200: DeploymentSerializer, 202: dict})
    @action(detail=True, methods=["post"])
    def wake(self, request, public_id=None):
        """Awake: 200 with the deployment. Not awake within ``SERVING_WAKE_WAIT_SECONDS`` (its wake waits
        for a start-up slot, or is waking): 202 with ``queued`` and ``position`` in line, while the wake goes on."""
        deployment = service.wake(self.actor, self.get_object())
        if deployment.state != S.SLEEPING:
            return self.render(deployment)
        position = gate.wake_position(deployment.replica_set.filter(state=S.SLEEPING))
        body = dict(DeploymentSerializer(deployment).data, queued=position is not None, position=position)
        return Response(body, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses={200: DeploymentEventSerializer(many=True)}, filters=False)
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
        data = self.parsed(SwitchInputSerializer)
        node = _node(data["node"]) if data.get("node") else source.node
        changes = {"model_path": data["model_path"], "config": data.get("config") or {}, "node": node,
                   "engine": data.get("engine") or source.engine, "runtime": data.get("runtime") or source.runtime}
        if node != source.node:  # A's accelerators stay on A's node
            changes.update(accelerator=None, shards=())
        if data.get("accelerator"):
            changes.update(accelerator=_accelerator(data["accelerator"], node), shards=())
        # B is A (its accelerators, shards, profile, owner, priority) but for what the request changes.
        target = service.DeployRequest.of(source, **changes)
        operation = operations.switch(self.actor, source, target)
        return self.render(operation, OperationSerializer, status.HTTP_202_ACCEPTED)

    @extend_schema(request=ReconfigureInputSerializer, responses={202: OperationSerializer})
    @action(detail=True, methods=["post"])
    def reconfigure(self, request, public_id=None):
        """Change engine settings in place: a switch to A with those settings (the same refusals)."""
        source = self.get_object()  # first: one outside the caller's reach is a 404, whatever the body
        data = self.parsed(ReconfigureInputSerializer)
        operation = operations.reconfigure(self.actor, source, data["config"])
        return self.render(operation, OperationSerializer, status.HTTP_202_ACCEPTED)

    @extend_schema(responses={200: OperationSerializer(many=True)}, filters=False)
    @action(detail=True, methods=["get"], url_path="operations")
    def operation_list(self, request, public_id=None):
        deployment = self.get_object()
        found = Operation.objects.filter(source=deployment) | Operation.objects.filter(target=deployment)
        return Response(OperationSerializer(found.distinct(), many=True).data)

    def destroy(self, request, public_id=None):
        service.remove(self.actor, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


def preview_body(result) -> dict:
    return {"estimate": result.estimate.as_dict(), "device": result.device,
            "fit": result.fit.as_dict() if result.fit else None, "notes": list(result.notes)}

