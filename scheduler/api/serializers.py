from rest_framework import serializers

from scheduler import reach
from scheduler.memory import ENGINES
from scheduler.models import (
    Accelerator,
    CalibrationRecord,
    EnrolmentToken,
    HeldWeight,
    ModelDirectory,
    Node,
    NodeEngine,
    PlacementDecision,
)
from scheduler.policy.inputs import GIB, DesiredModel, Profile, Scaling


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

    def get_parent(self, obj) -> str | None:
        return str(obj.parent.public_id) if obj.parent_id else None

    def get_reserved_bytes(self, obj) -> int:
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
    """A node's capacity for everyone; its model directories (paths and files) for staff only
    (``scheduler.reach``): the field is absent for others, and without a request in the context."""

    id = serializers.UUIDField(source="public_id", read_only=True)
    engines = NodeEngineSerializer(many=True, read_only=True)
    accelerators = AcceleratorSerializer(many=True, read_only=True)
    model_directories = ModelDirectorySerializer(many=True, read_only=True)
    credential_state = serializers.ChoiceField(
        choices=["none", "active", "revoked"], read_only=True,
        help_text="none: no credential issued (a node from before enrolment); active; revoked.")

    class Meta:
        model = Node
        fields = ["id", "name", "address", "labels", "state", "cpu_count", "cpu_load_1m", "memory_total_bytes",
                  "memory_available_bytes", "unified_memory", "agent_version", "driver_version", "gpu_source",
                  "gpu_note", "last_heartbeat_at", "credential_state", "credential_issued_at", "revoked_at",
                  "engines", "accelerators", "model_directories"]

    def get_fields(self):
        fields = super().get_fields()
        request = self.context.get("request")
        if request is None or not reach.sees_everything(request.user):
            fields.pop("model_directories")
        return fields


class NodeLabelsSerializer(serializers.Serializer):
    """The node's labels, all of them (what is not named is removed); checked by ``scheduler.labels``."""

    labels = serializers.DictField(child=serializers.JSONField(), allow_empty=True)


class EnrolmentTokenSerializer(serializers.ModelSerializer):
    """An enrolment token as it is listed: never its secret (``token`` only answers its creation)."""

    id = serializers.UUIDField(source="public_id", read_only=True)
    node = serializers.SerializerMethodField(help_text="The registered node it issues a credential for "
                                                       "(--existing), else null.")
    used_by_node = serializers.SerializerMethodField()
    state = serializers.SerializerMethodField(help_text="pending, used or expired.")
    prefix = serializers.SerializerMethodField(help_text="bne_<lookup>_: what a secret scanner would find.")

    class Meta:
        model = EnrolmentToken
        fields = ["id", "prefix", "name", "node", "state", "created_by", "created_at", "expires_at", "used_at",
                  "used_by_node"]

    def get_node(self, obj) -> str | None:
        return obj.node.name if obj.node_id else None

    def get_used_by_node(self, obj) -> str | None:
        return obj.used_by_node.name if obj.used_by_node_id else None

    def get_state(self, obj) -> str:
        return obj.state()

    def get_prefix(self, obj) -> str:
        return f"bne_{obj.lookup}_"


class IssuedEnrolmentTokenSerializer(EnrolmentTokenSerializer):
    """The answer to a token's creation: the only time its plaintext is said."""

    token = serializers.SerializerMethodField(help_text="bne_…: give it to the agent "
                                                        "(manage.py agent --server URL --token T); shown once.")

    class Meta(EnrolmentTokenSerializer.Meta):
        fields = [*EnrolmentTokenSerializer.Meta.fields, "token"]

    def get_token(self, obj) -> str:
        return self.context["plaintext"]


class EnrolmentTokenRequestSerializer(serializers.Serializer):
    name = serializers.CharField(required=False, allow_blank=True, max_length=253, default="",
                                 help_text="The node it enrols; blank: the agent says its own name.")
    existing = serializers.CharField(required=False, allow_blank=True, max_length=253, default="",
                                     help_text="A registered node's name: the token issues a new credential "
                                               "for it (how nodes from before enrolment get one).")
    expires_minutes = serializers.IntegerField(required=False, default=60, min_value=1, max_value=7 * 24 * 60)


class EnrolRequestSerializer(serializers.Serializer):
    token = serializers.CharField(max_length=300, trim_whitespace=True)
    name = serializers.CharField(required=False, allow_blank=True, max_length=253, default="",
                                 help_text="This node's name, when the token does not name it.")
    address = serializers.CharField(required=False, allow_blank=True, max_length=255, default="",
                                    help_text="Where this node's engines are reached (a host name or IP).")


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
                  "measured_bytes", "measurement", "error_percent", "outcome", "evidence", "created_at"]

    def get_error_percent(self, obj) -> float | None:
        if not obj.measured_bytes:
            return None
        return round((obj.estimated_bytes - obj.measured_bytes) * 100 / obj.measured_bytes, 2)


class PlacementDecisionSerializer(serializers.ModelSerializer):
    class Meta:
        model = PlacementDecision
        fields = ["public_id", "kind", "model", "verdict", "reason_codes", "detail", "inputs_digest", "fingerprint",
                  "node", "accelerators", "victims", "headroom_before_bytes", "headroom_after_bytes", "evidence",
                  "created_at"]


MAX_GIB = 1 << 20


class PolicyProfileSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=64)
    engine = serializers.ChoiceField(choices=["llamacpp", "vllm"], default="vllm")
    gpus = serializers.IntegerField(min_value=0, max_value=64, default=1)
    # Bounded (a pebibyte) so that GiB → bytes stays a number: 1e308 GiB is no size.
    memory_gib = serializers.FloatField(min_value=0, max_value=MAX_GIB)
    cpu_cores = serializers.IntegerField(min_value=0, default=0)
    accelerator_class = serializers.ListField(child=serializers.CharField(max_length=128), required=False,
                                              default=list, help_text="Classes any of which it may run on; "
                                                                      "empty: any. One class may be given as a text.")
    node_selector = serializers.DictField(child=serializers.CharField(allow_blank=True), required=False, default=dict)
    allow_mig = serializers.BooleanField(default=True)
    min_disk_gib = serializers.FloatField(min_value=0, max_value=MAX_GIB, default=0)
    priority = serializers.IntegerField(default=0)

    def to_internal_value(self, data):
        if isinstance(data, dict) and isinstance(data.get("accelerator_class"), str):
            data = {**data, "accelerator_class": [data["accelerator_class"]] if data["accelerator_class"] else []}
        return super().to_internal_value(data)


class PolicyModelSerializer(serializers.Serializer):
    """A model's shape for a dry run: what Serving's catalog would hand the policy."""

    model = serializers.CharField(max_length=255)
    profiles = PolicyProfileSerializer(many=True)
    min = serializers.IntegerField(min_value=0, default=1)
    max = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    idle_timeout_s = serializers.IntegerField(min_value=0, default=900)
    capacity_class = serializers.ChoiceField(choices=["", "critical", "standard", "opportunistic"], default="")
    owner = serializers.CharField(max_length=255, required=False, default="", allow_blank=True,
                                  help_text="The owner scope (acme/ml, team:acme/ml or its id) among those you see; "
                                            "empty: shared, counted against nobody.")
    limit = serializers.IntegerField(min_value=1, max_value=64, default=16)

    def validate(self, data):
        if not data["profiles"]:
            raise serializers.ValidationError({"profiles": "At least one profile."})
        if data.get("max") is not None and data["max"] < data["min"]:
            raise serializers.ValidationError({"max": "max must be at least min."})
        return data

    def desired(self, owner: str = ""):
        """The policy's model; ``owner`` is the owner scope's path, resolved by the caller
        (``scheduler.reach.resolve_owner``), never the text as written."""
        data = self.validated_data
        profiles = tuple(Profile(name=p["name"], engine=p["engine"], gpus=p["gpus"],
                                 memory_bytes=int(p["memory_gib"] * GIB), cpu_cores=p["cpu_cores"],
                                 accelerator_class=tuple(p["accelerator_class"]), node_selector=p["node_selector"],
                                 allow_mig=p["allow_mig"], min_disk_bytes=int(p["min_disk_gib"] * GIB),
                                 priority=p["priority"]) for p in data["profiles"])
        return DesiredModel(data["model"], profiles, Scaling(min=data["min"], max=data.get("max"),
                                                             idle_timeout_s=data["idle_timeout_s"]),
                            capacity_class=data["capacity_class"], owner=owner)


class ParkedModelSerializer(serializers.Serializer):
    """A parked model (or, answering a retry, the model's reset failure memory)."""

    model = serializers.CharField()
    parked = serializers.BooleanField()
    kind = serializers.CharField(help_text="The last failure: crash, oom or hang (empty once reset).")
    consecutive = serializers.IntegerField(allow_null=True, help_text="Failed launches in a row.")
    level = serializers.IntegerField(allow_null=True, help_text="0 full, 1 degraded, 2 fallback.")
    last_error = serializers.CharField()
    last_failure_at = serializers.DateTimeField(allow_null=True)
    since = serializers.DateTimeField(allow_null=True, help_text="When it was parked.")
    detail = serializers.CharField(help_text="Why it is parked, as a person reads it.")
    retried_by = serializers.CharField(help_text="Who last retried it (an actor), if anyone.")
    retried_at = serializers.DateTimeField(allow_null=True)
    retriable = serializers.BooleanField(help_text="Whether a retry would reset anything now: false once reset, "
                                                   "or when only a decision says it is parked.")


class UnplaceableModelSerializer(serializers.Serializer):
    model = serializers.CharField()
    verdict = serializers.CharField()
    detail = serializers.CharField()
    reason_codes = serializers.ListField(child=serializers.CharField())
    created_at = serializers.DateTimeField()


class ParkedAndUnplaceableSerializer(serializers.Serializer):
    parked = ParkedModelSerializer(many=True)
    unplaceable = UnplaceableModelSerializer(many=True)
