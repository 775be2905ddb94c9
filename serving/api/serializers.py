from rest_framework import serializers

from serving.deployments import gate
from serving.models import Deployment, DeploymentEvent, Operation, Replica


class ReplicaSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    node = serializers.CharField(source="node.name", read_only=True)
    queue_position = serializers.SerializerMethodField()

    class Meta:
        model = Replica
        fields = ["id", "node", "port", "state", "queue_position", "memory_reserved_bytes", "peak_memory_bytes",
                  "queued_at", "started_at", "ready_at", "stopped_at", "exit_reason"]

    def get_queue_position(self, replica) -> int | None:
        return gate.position(replica)


class DeploymentSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    node = serializers.CharField(source="node.name", read_only=True)
    owner = serializers.SerializerMethodField()
    replicas = ReplicaSerializer(source="replica_set", many=True, read_only=True)

    class Meta:
        model = Deployment
        fields = ["id", "name", "task", "engine", "runtime", "model_path", "config", "node", "gpu_uuids", "owner",
                  "priority", "cores", "memory_reserved_bytes", "state", "state_detail", "estimate", "replicas",
                  "created_at", "updated_at"]

    def get_owner(self, deployment) -> str | None:
        return deployment.owner.written if deployment.owner else None


class DeployInputSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    model_path = serializers.CharField(max_length=1024)
    node = serializers.CharField(help_text="Node name or id.")
    engine = serializers.ChoiceField(choices=Deployment.Engine.choices, default=Deployment.Engine.LLAMACPP)
    runtime = serializers.ChoiceField(choices=Deployment.Runtime.choices, default=Deployment.Runtime.PROCESS)
    task = serializers.ChoiceField(choices=Deployment.Task.choices, default=Deployment.Task.CHAT)
    config = serializers.DictField(required=False, default=dict)
    accelerator = serializers.CharField(required=False, allow_blank=True, help_text="GPU or MIG UUID.")
    owner = serializers.CharField(required=False, allow_blank=True, help_text="A scope, e.g. project:acme/ml/search.")
    priority = serializers.IntegerField(min_value=0, max_value=100, default=50)
    cores = serializers.IntegerField(min_value=1, required=False, allow_null=True)
    actions = serializers.ListField(child=serializers.DictField(), required=False, default=list,
                                    help_text="A plan's actions to apply first: [{kind: sleep|stop, target: name}].")


class DeploymentEventSerializer(serializers.ModelSerializer):
    replica = serializers.UUIDField(source="replica.public_id", read_only=True, allow_null=True)

    class Meta:
        model = DeploymentEvent
        fields = ["at", "replica", "from_state", "to_state", "message", "log_tail"]


class SwitchInputSerializer(serializers.Serializer):
    """What B is; it takes A's model name."""

    model_path = serializers.CharField(max_length=1024)
    node = serializers.CharField(required=False, help_text="Node name or id (default: A's node).")
    engine = serializers.ChoiceField(choices=Deployment.Engine.choices, required=False)
    runtime = serializers.ChoiceField(choices=Deployment.Runtime.choices, required=False)
    config = serializers.DictField(required=False, default=dict)
    accelerator = serializers.CharField(required=False, max_length=100, help_text=(
        "Accelerator UUID on B's node (default: A's accelerators on A's node, none on another node)."))


class ReconfigureInputSerializer(serializers.Serializer):
    config = serializers.DictField(help_text="Engine settings to change; the rest stay as they are.")


class OperationSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    source = serializers.UUIDField(source="source.public_id", read_only=True, allow_null=True)
    target = serializers.UUIDField(source="target.public_id", read_only=True, allow_null=True)

    class Meta:
        model = Operation
        fields = ["id", "kind", "state", "source", "target", "request", "steps", "message", "created_at",
                  "finished_at"]
