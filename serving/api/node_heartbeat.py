"""``POST /api/node/heartbeat/``: a node's beat — its report (registered again) and what its agent
sees of its engines (``serving.control.node_reports``). A node reports only itself: a report under
another node's name, or about another node's replica, is refused (403, audited)."""

from __future__ import annotations

import uuid

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from scheduler.api.node_auth import IsNode, NodeAuthentication, refuse_foreign
from scheduler.errors import InvalidNodeReport
from scheduler.reports import from_wire
from scheduler.services import NodeReport, register_node
from serving.control import node_reports
from serving.models import Replica
from serving.runtimes.base import EngineSeen

MAX_ENGINES = 1000  # a beat stays small whatever runs on the node


class HeartbeatSerializer(serializers.Serializer):
    report = serializers.DictField(help_text="The node's report: NodeReport's fields (telemetry, GPUs, engines, "
                                             "model directories).")
    engines = serializers.ListField(child=serializers.DictField(), default=list, max_length=MAX_ENGINES,
                                    help_text="Each managed engine the agent sees: handle, running, and once ended "
                                              "its exit and log tail.")
    first = serializers.BooleanField(default=False, help_text="The agent has just started: adopt what it finds.")
    agent = serializers.CharField(default="", allow_blank=True, max_length=64,
                                  help_text="The agent's instance (new at each start): its claims carry it too.")


class HeartbeatAnswerSerializer(serializers.Serializer):
    expected = serializers.ListField(child=serializers.DictField(), help_text="The engines that should run there.")


class HeartbeatView(APIView):
    authentication_classes = [NodeAuthentication]
    permission_classes = [IsNode]

    @extend_schema(request=HeartbeatSerializer, responses={
        200: HeartbeatAnswerSerializer, 400: OpenApiResponse(description="invalid_node_report"),
        401: OpenApiResponse(description="node_credential_invalid or node_revoked"),
        403: OpenApiResponse(description="node_ownership_mismatch: another node's name or replica (audited)")})
    def post(self, request):
        node = request.auth
        body = HeartbeatSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            report = from_wire(NodeReport, body.validated_data["report"], "report")
            seen = [EngineSeen.from_wire(engine) for engine in body.validated_data["engines"]]
        except (ValueError, KeyError, TypeError) as error:
            raise InvalidNodeReport(f"The heartbeat is malformed: {error}") from error
        if report.name != node.name:
            refuse_foreign(node, f"report as node {report.name!r}", node)
        ids = {engine.handle.replica_id for engine in seen}
        foreign = Replica.objects.filter(public_id__in=[i for i in ids if _is_uuid(i)]).exclude(node=node).first()
        if foreign is not None:
            refuse_foreign(node, "report on a replica", foreign)
        return Response(node_reports.beat(register_node(report), seen, first=body.validated_data["first"],
                                          agent=body.validated_data["agent"]))


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True
