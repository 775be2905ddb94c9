"""``GET /api/serving/status/``: the fleet at a glance for the console's dashboard, the figures
``manage.py status`` prints (``serving.control.status.summary``), narrowed to what the caller may
see: the fleet's capacity and nodes for everyone, models, replicas and failures within their reach."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from serving.control import status
from serving.control import watchdog


def figures(caller) -> dict:
    """The summary with the nodes' memory levels (the watchdog's, which the control floor cannot read)."""
    return status.summary(caller, levels=watchdog.levels)


class CapacitySerializer(serializers.Serializer):
    accelerator_class = serializers.CharField()
    total = serializers.IntegerField(help_text="Placeable units: GPUs, or the MIG instances of a card in MIG mode.")
    in_use = serializers.IntegerField(help_text="Units holding a memory reservation.")
    free = serializers.IntegerField(help_text="Units on ready nodes, placeable and healthy, holding nothing.")
    unavailable = serializers.IntegerField(help_text="Units holding nothing that cannot be placed on now.")
    used_percent = serializers.FloatField()
    memory_total_bytes = serializers.IntegerField()
    memory_reserved_bytes = serializers.IntegerField()


class NodeLevelSerializer(serializers.Serializer):
    name = serializers.CharField()
    state = serializers.CharField()
    watchdog = serializers.CharField(allow_null=True, help_text="ok, warning or critical; null: not known.")


class ModelStatusSerializer(serializers.Serializer):
    name = serializers.CharField()
    owner = serializers.CharField(allow_null=True, help_text="The owning scope's path; null: shared.")
    ready = serializers.IntegerField()
    wanted = serializers.IntegerField()
    starting = serializers.IntegerField()
    state = serializers.CharField(help_text="serving, starting, parked, unplaceable, idle or stopped.")
    reason = serializers.CharField()
    satisfied = serializers.BooleanField(help_text="Has what it should have now; a parked model never is.")
    nodes = serializers.ListField(child=serializers.CharField())


class SatisfiedSerializer(serializers.Serializer):
    satisfied = serializers.IntegerField()
    total = serializers.IntegerField()


class ModelReasonSerializer(serializers.Serializer):
    name = serializers.CharField()
    reason = serializers.CharField()


class IdleReplicaSerializer(serializers.Serializer):
    model = serializers.CharField()
    replica = serializers.UUIDField()
    node = serializers.CharField()
    state = serializers.CharField()
    idle_seconds = serializers.IntegerField()


class FailureSerializer(serializers.Serializer):
    deployment = serializers.CharField()
    node = serializers.CharField()
    at = serializers.DateTimeField()
    from_state = serializers.CharField()
    message = serializers.CharField()


class StatusSerializer(serializers.Serializer):
    capacity = CapacitySerializer(many=True)
    free_nodes = serializers.ListField(child=serializers.CharField())
    nodes = NodeLevelSerializer(many=True)
    models = ModelStatusSerializer(many=True)
    satisfied = SatisfiedSerializer()
    parked = ModelReasonSerializer(many=True)
    unplaceable = ModelReasonSerializer(many=True)
    idle_replicas = IdleReplicaSerializer(many=True)
    failures = FailureSerializer(many=True)


class StatusView(APIView):
    """The fleet's capacity per accelerator class, free whole nodes, the memory level per node; the
    caller's models satisfied against what they should have now, parked and unplaceable ones with
    why, replicas nobody used in a day, and the latest failures of the last 24 hours."""

    @extend_schema(responses={200: StatusSerializer})
    def get(self, request):
        return Response(figures(request.user))
