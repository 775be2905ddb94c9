from rest_framework import serializers

from gateway.models import UsageRecord


class UsageRecordSerializer(serializers.ModelSerializer):
    client = serializers.SerializerMethodField()

    class Meta:
        model = UsageRecord
        fields = ["request_id", "started_at", "finished_at", "endpoint", "stream", "model_asked", "model_served",
                  "replica_id", "status", "error_code", "queue_ms", "ttft_ms", "total_ms", "prompt_tokens",
                  "completion_tokens", "cost", "key_prefix", "client", "scope_path"]

    def get_client(self, record) -> str | None:
        return str(record.client.public_id) if record.client_id and record.client else None


class ModelSplitSerializer(serializers.Serializer):
    """A canary/experiment split: ``model_name`` → ``variants`` by weight, sticky per client."""

    id = serializers.UUIDField(source="public_id", read_only=True)
    model_name = serializers.CharField(max_length=200)
    scope = serializers.CharField(allow_null=True, required=False, default=None,
                                  help_text="The scope path whose clients the split applies to; null: every client "
                                            "(staff only).")
    variants = serializers.ListField(child=serializers.DictField(), required=False, default=list,
                                     help_text='[{"model": "name", "weight": 90}, …]')
    environments = serializers.ListField(child=serializers.ChoiceField(["production", "staging", "development"]),
                                         required=False, default=list,
                                         help_text="Client environments allowed to call model_name; empty: any.")
    enabled = serializers.BooleanField(required=False, default=True)
    note = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    created_at = serializers.DateTimeField(read_only=True)
    updated_at = serializers.DateTimeField(read_only=True)

    def to_representation(self, split):
        data = super().to_representation(split)
        data["scope"] = split.scope.path if split.scope_id else None
        return data
