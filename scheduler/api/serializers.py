from rest_framework import serializers

from scheduler.models import Node, NodeEngine


class NodeEngineSerializer(serializers.ModelSerializer):
    class Meta:
        model = NodeEngine
        fields = ["kind", "version", "source", "state", "detail", "updated_at"]


class NodeSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    engines = NodeEngineSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = ["id", "name", "address", "labels", "state", "cpu_count", "memory_total_bytes",
                  "memory_available_bytes", "agent_version", "last_heartbeat_at", "engines"]
