from rest_framework import serializers

from scheduler.memory import ENGINES
from scheduler.models import Accelerator, CalibrationRecord, HeldWeight, ModelDirectory, Node, NodeEngine


class NodeEngineSerializer(serializers.ModelSerializer):
    class Meta:
        model = NodeEngine
        fields = ["kind", "version", "source", "state", "detail", "updated_at"]


class AcceleratorSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    node = serializers.UUIDField(source="node.public_id", read_only=True)
    parent = serializers.SerializerMethodField()
    reserved_bytes = serializers.SerializerMethodField()

    class Meta:
        model = Accelerator
        fields = ["id", "node", "parent", "kind", "index", "mig_index", "uuid", "name", "accelerator_class", "profile",
                  "pci_bus_id", "mig_enabled", "memory_total_bytes", "memory_used_bytes", "reserved_bytes",
                  "utilisation_percent", "temperature_c", "power_watts", "power_limit_watts", "throttle_reasons",
                  "healthy", "health_reason", "placeable", "unplaceable_reason", "updated_at"]

    def get_parent(self, obj):
        return str(obj.parent.public_id) if obj.parent_id else None

    def get_reserved_bytes(self, obj):
        return sum(r.bytes for r in obj.reservations.all())


class HeldWeightSerializer(serializers.ModelSerializer):
    class Meta:
        model = HeldWeight
        fields = ["path", "size_bytes", "format"]


class ModelDirectorySerializer(serializers.ModelSerializer):
    weights = HeldWeightSerializer(many=True, read_only=True)

    class Meta:
        model = ModelDirectory
        fields = ["path", "weights"]


class NodeSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    engines = NodeEngineSerializer(many=True, read_only=True)
    accelerators = AcceleratorSerializer(many=True, read_only=True)
    model_directories = ModelDirectorySerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = ["id", "name", "address", "labels", "state", "cpu_count", "cpu_load_1m", "memory_total_bytes",
                  "memory_available_bytes", "unified_memory", "agent_version", "driver_version", "gpu_source",
                  "gpu_note", "last_heartbeat_at", "engines", "accelerators", "model_directories"]


class NodeActionSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=500, default="")


class EstimateRequestSerializer(serializers.Serializer):
    model_path = serializers.CharField(max_length=4096)
    engine = serializers.ChoiceField(choices=ENGINES, default="llamacpp")
    config = serializers.DictField(required=False, default=dict)
    engine_version = serializers.CharField(required=False, allow_blank=True, max_length=128)
    node = serializers.UUIDField(required=False, allow_null=True)
    accelerator = serializers.UUIDField(required=False, allow_null=True)


class CalibrationRecordSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    error_percent = serializers.SerializerMethodField()

    class Meta:
        model = CalibrationRecord
        fields = ["id", "model_key", "model_name", "engine", "engine_version", "device", "config", "estimated_bytes",
                  "measured_bytes", "error_percent", "outcome", "evidence", "created_at"]

    def get_error_percent(self, obj):
        if not obj.measured_bytes:
            return None
        return round((obj.estimated_bytes - obj.measured_bytes) * 100 / obj.measured_bytes, 2)
